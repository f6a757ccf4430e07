"""One timed fit() in this interpreter's environment, for bench_versions (run as a subprocess
by each environment's python): prints one JSON line with the versions and seconds."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import spark_session  # noqa: E402


def main(source: str, epochs: int) -> None:
    import pyarrow
    import pyspark
    import torch

    from sparkring import SparkRingEstimator, Store

    spark = spark_session()
    spark.sparkContext.setLogLevel("ERROR")
    df = spark.read.parquet(source)
    rows = df.count()

    def fit(frame, n_epochs):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        est = SparkRingEstimator(model=net, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss="cross_entropy",
                                 featuresCol="features", labelCol="label", batchSize=256, epochs=n_epochs, numProc=2,
                                 store=Store(tempfile.mkdtemp(prefix="sparkring-bench-fit-")), verbose=0)
        return est.fit(frame)

    fit(df.limit(2048), 1)  # warms the Python workers and the JIT of the session
    start = time.perf_counter()
    model = fit(df, epochs)
    seconds = time.perf_counter() - start
    spark.stop()
    print(json.dumps({"pyspark": pyspark.__version__, "pyarrow": pyarrow.__version__, "rows": rows,
                      "epochs": epochs, "seconds": seconds, "loss": model.history[-1]["loss"]}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
