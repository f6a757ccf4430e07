"""Shared helpers for the benchmarks: a local Spark session, timing, the results table."""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from typing import Callable, List

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join([BENCH_DIR, os.path.dirname(BENCH_DIR), os.environ.get("PYTHONPATH", "")])


def spark_session(master: str = "local[2]"):
    from pyspark.sql import SparkSession

    return (SparkSession.builder.master(master).appName("sparkring-bench")
            .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.memory", "6g")
            .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
            .config("spark.sql.execution.arrow.maxRecordsPerBatch", "10000")
            .getOrCreate())


def vector_df(spark, n, d=64, partitions=4):
    """``n`` rows of a ``d``-float vector and a label of 10 classes, made by Spark."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    return (spark.range(n, numPartitions=partitions)
            .select(array_to_vector(F.array(*[F.rand(i).cast("float") for i in range(d)])).alias("features"),
                    (F.rand(99) * 10).cast("int").cast("double").alias("label")))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(ours: Callable, baseline: Callable, reps: int, settle: float = 0.0):
    """Run the two side by side, alternating, and return the median seconds of each; ``settle``
    seconds of quiet before each run let what the other side left running (its workers' garbage
    collection after a task) finish off the clock of neither."""
    a, b = [], []
    for _ in range(reps):
        time.sleep(settle)
        a.append(timed(ours))
        time.sleep(settle)
        b.append(timed(baseline))
    return statistics.median(a), statistics.median(b)


@contextlib.contextmanager
def own_python_workers(spark):
    """UDFs made inside run in Python workers of their own, as each side would in a job of its own:
    Spark keeps one pool of reused workers per environment (the environment a UDF is made with
    travels with it), and what one side leaves in a shared worker (its imports and models, which
    PySpark's garbage collection after every task walks) would change the other's time."""
    environment = spark.sparkContext.environment
    environment["SPARKRING_BENCH_WORKERS"] = "baseline"
    try:
        yield
    finally:
        del environment["SPARKRING_BENCH_WORKERS"]


class Row:
    def __init__(self, group: str, what: str, ours: str, baseline: str, ratio: float, goal: str, higher_is_better=True,
                 goal_value: float = None):
        self.group, self.what, self.ours, self.baseline = group, what, ours, baseline
        self.ratio, self.goal = ratio, goal
        if goal_value is None:
            self.met = ""
        else:
            self.met = "yes" if (ratio >= goal_value if higher_is_better else ratio <= goal_value) else "**no**"


def write_table(rows: List[Row], path: str, header: str, footer: str = "") -> None:
    lines = [header, "", "| area | measurement | sparkring | baseline | ratio | goal | met |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.group} | {r.what} | {r.ours} | {r.baseline} | {r.ratio:.2f}x | {r.goal} | {r.met} |")
    if footer:
        lines += ["", footer.rstrip()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def standalone_session(master: str, ranks: int, **conf: str):
    """A session on a loopback standalone cluster (the driver-side scripts' setup), once ``ranks``
    task slots have registered; ``conf``: extra Spark settings."""
    import sys

    from pyspark.sql import SparkSession

    from sparkring.runner.driver.session import wait_for_slots

    builder = (SparkSession.builder.master(master).config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1").config("spark.ui.enabled", "false")
               .config("spark.executor.memory", "900m")
               .config("spark.executorEnv.PYTHONPATH",
                       os.pathsep.join(sys.path[:2] + [os.environ.get("PYTHONPATH", "")]))
               .config("spark.executorEnv.OMP_NUM_THREADS", "1"))
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    assert wait_for_slots(spark, ranks, timeout=90), "the executors did not register"
    return spark


def cluster_script(script: str, scratch: str) -> dict:
    """Run one of the standalone-cluster driver scripts beside this file (each in a process of its
    own: one SparkContext per process); the JSON its last line prints."""
    import json
    import subprocess
    import sys

    os.makedirs(scratch, exist_ok=True)
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), script), scratch],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
