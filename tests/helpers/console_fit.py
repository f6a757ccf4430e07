"""A fit() as a user runs it from a script (tests/estimator/test_console.py runs it in a terminal and in a
pipe): Spark's own console progress bar on, as in the pyspark shell; then a slow Spark job to
show Spark's bar is back after fit."""
import os
import sys
import time

os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ["PYSPARK_PYTHON"] = sys.executable

import est_helpers as H  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from sparkring import SparkRingEstimator, Store  # noqa: E402


def pause(x):
    time.sleep(2.5)
    return x


if __name__ == "__main__":
    spark = (SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "true")
             .config("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", "")).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = H.classification_df(spark, n=1280)
    model = SparkRingEstimator(model=H.Slow(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=2,
                               numProc=2, store=Store(sys.argv[1]), verbose=1).fit(df)
    print("FIT-DONE", flush=True)
    model.transform(df).count()
    print("TRANSFORM-DONE", flush=True)
    spark.sparkContext.parallelize(range(2), 2).map(pause).collect()
    print("AFTER-DONE", flush=True)
    spark.stop()
