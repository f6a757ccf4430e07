"""An elastic run() on a local-cluster whose executor is killed while it trains (the worker
starts a new one, as a cluster manager replaces a lost node): the driver process the
"elastic" benchmark times. Argument: the file rank 0 stamps its steps into."""
import os
import sys

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

if __name__ == "__main__":
    from pyspark.sql import SparkSession

    here = os.path.dirname(os.path.abspath(__file__))
    spark = (SparkSession.builder.master("local-cluster[2,1,1024]").config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.executor.memory", "512m")
             .config("spark.executorEnv.PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
             .getOrCreate())
    import bench_fns

    import sparkring

    print("steps:", sparkring.run(bench_fns.elastic_steps, args=(sys.argv[1],), num_proc=2, min_proc=1,
                                  start_timeout=60, verbose=1), flush=True)
    spark.stop()
