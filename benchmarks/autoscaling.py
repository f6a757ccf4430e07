"""Multi-rank tasks and autoscaling on loopback standalone clusters: the driver process the
"autoscaling" benchmark reads from. (1) run() of 4 ranks as 2 tasks x 2 ranks beside 4 tasks x 1
(two workers of two cores), wall time, alternating. (2) A fit's seconds from fit() to its first
training step on a fixed-size cluster (the executors up before the fit) beside the same fit under
dynamic allocation started with no executor (their start included). Argument: a scratch directory.
Prints one JSON line."""
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests", "helpers")]

REPS, ROWS = 5, 2048
AUTOSCALING = {"spark.dynamicAllocation.enabled": "true", "spark.dynamicAllocation.shuffleTracking.enabled": "true",
               "spark.dynamicAllocation.minExecutors": "0", "spark.dynamicAllocation.initialExecutors": "0",
               "spark.dynamicAllocation.maxExecutors": "2", "spark.dynamicAllocation.executorIdleTimeout": "5s",
               "spark.executor.cores": "1"}


def _launch_seconds(spark) -> dict:
    import bench_fns
    from common import timed

    from sparkring import run

    layouts = {"2x2": dict(num_proc=4, ranks_per_task=2), "4x1": dict(num_proc=4)}
    for kw in layouts.values():
        run(bench_fns.trivial_allreduce, verbose=0, **kw)  # Python workers up on every executor
    seconds = {name: [] for name in layouts}
    for _ in range(REPS):
        for name, kw in layouts.items():
            seconds[name].append(timed(lambda: run(bench_fns.trivial_allreduce, verbose=0, **kw)))
    return {name: statistics.median(values) for name, values in seconds.items()}


def _to_first_step(spark, scratch: str, name: str) -> float:
    import bench_fns
    import torch
    from common import vector_df

    from sparkring import SparkRingEstimator, Store

    audit = os.path.join(scratch, f"audit-{name}")
    os.makedirs(audit)
    df = vector_df(spark, ROWS, partitions=2)
    began = time.time()
    SparkRingEstimator(model=bench_fns.CountsSteps(audit, seconds=0.0), optimizer=lambda p: torch.optim.Adam(p),
                       loss="cross_entropy", batchSize=64, epochs=1, numProc=2,
                       store=Store(os.path.join(scratch, name)), verbose=0, startTimeout=120).fit(df)
    first = min(float(open(os.path.join(audit, f)).readline()) for f in os.listdir(audit))
    return first - began


def main(scratch: str) -> None:
    from common import standalone_session
    from standalone_cluster import StandaloneCluster

    out = {}
    cluster = StandaloneCluster(tempfile.mkdtemp(dir=scratch), dict(os.environ)).start(["127.0.0.2", "127.0.0.3"],
                                                                                       cores=2)
    try:
        spark = standalone_session(cluster.master, 4)
        out["launch"] = _launch_seconds(spark)
        out["fixed_first_step"] = _to_first_step(spark, scratch, "fixed")
        spark.stop()
        from pyspark import SparkContext

        SparkContext._active_spark_context = None
        spark = standalone_session(cluster.master, 0, **AUTOSCALING)
        out["autoscaled_first_step"] = _to_first_step(spark, scratch, "autoscaled")
        spark.stop()
    finally:
        cluster.stop()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
