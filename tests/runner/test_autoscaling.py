"""Training on an autoscaling cluster (dynamic allocation with shuffle tracking on a standalone
cluster of three workers, 0 to 2 executors): the ranks run as an ordinary stage whose tasks meet
at the driver, from no executor at all, and the executors go once the run is over."""
import os
import subprocess
import sys

import ddp_fns
import est_helpers as H
import numpy as np
import torch
from pyspark.ml.linalg import Vectors
from waiting import wait_until

from sparkring import SparkRingEstimator, Store, run


def _executors(spark) -> int:
    infos = spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
    return len(infos) - 1  # the driver is listed too


def _released(spark) -> bool:
    return wait_until(lambda: _executors(spark) == 0, timeout=40, every=0.5)


def test_run_starts_from_no_executor_trains_the_fixed_size_weights_and_releases_them(spark_autoscale):
    assert _released(spark_autoscale)  # the application has no executor before the run
    [result, _] = run(ddp_fns.ddp_user_init, num_proc=2, start_timeout=90)
    reference = ddp_fns.reference(2)  # one process on both ranks' batches: what two fixed ranks train
    for key, value in reference.items():
        torch.testing.assert_close(result["state"][key], value, atol=1e-5, rtol=0)
    assert _released(spark_autoscale)  # idle after the run: dynamic allocation gives them back


def _ordered_df(spark, n=240):
    """Rows in one fixed order (no shuffle): every preparation of it lays them out alike."""
    rng = np.random.default_rng(0)
    centers = rng.normal(0, 3, size=(3, 8))
    labels = rng.integers(0, 3, size=n)
    x = centers[labels] + rng.normal(0, 1, size=(n, 8))
    return spark.createDataFrame([(i, Vectors.dense(x[i]), float(labels[i])) for i in range(n)],
                                 ["id", "features", "label"]).coalesce(1)


def _estimator(store, **kw):
    params = dict(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=2, numProc=2,
                  seed=3, store=store, verbose=0, keepData=True, startTimeout=90)
    params.update(kw)
    return SparkRingEstimator(**params)


def test_fit_from_no_executor_trains_the_weights_of_a_fit_on_executors_already_there(spark_autoscale, tmp_path):
    df, store = _ordered_df(spark_autoscale), Store(str(tmp_path / "store"))
    assert _released(spark_autoscale)
    cold = _estimator(store, runId="cold").fit(df)  # the executors start for it (its data job, then the ranks)
    warm = _estimator(store, runId="warm").fit(df)  # right after, on its prepared rows: the executors still there
    for key, value in cold.getModel().state_dict().items():
        torch.testing.assert_close(warm.getModel().state_dict()[key], value, atol=1e-5, rtol=0)
    assert [h["epoch"] for h in cold.history] == [0, 1] and cold.history[-1]["loss"] < cold.history[0]["loss"]
    assert _released(spark_autoscale)


def test_an_elastic_fit_starts_with_the_executors_the_bound_allows_and_says_why_not_more(spark_autoscale,
                                                                                        tmp_path, capsys):
    df, store = _ordered_df(spark_autoscale), Store(str(tmp_path / "store"))
    fitted = _estimator(store, runId="bounded", numProc=3, minProc=2, startTimeout=90, verbose=1).fit(df)
    said = capsys.readouterr()
    assert "going on with 2 of 3 ranks" in said.err + said.out
    assert "spark.dynamicAllocation.maxExecutors=2" in said.err + said.out
    assert [h["epoch"] for h in fitted.history] == [0, 1] and fitted.history[-1]["loss"] < fitted.history[0]["loss"]
    assert _released(spark_autoscale)


CONNECT_RUN = """
import sys
from pyspark.sql import SparkSession
import rank_fns, sparkring
spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
print("RESULT", [r["sum"] for r in sparkring.run(rank_fns.whoami, num_proc=2, spark=spark, start_timeout=120)])
"""


def test_run_from_a_spark_connect_client_under_dynamic_allocation(spark_autoscale, tmp_path):
    """A Connect server whose application autoscales on the same three workers (the client in a
    process of its own: a Connect session makes its process Connect-only)."""
    from connect_server import ConnectServer

    assert _released(spark_autoscale)  # this application's executors gone: the workers are free
    autoscaling = {key: spark_autoscale.conf.get(key) for key in (
        "spark.dynamicAllocation.enabled", "spark.dynamicAllocation.shuffleTracking.enabled",
        "spark.dynamicAllocation.minExecutors", "spark.dynamicAllocation.maxExecutors",
        "spark.dynamicAllocation.executorIdleTimeout", "spark.executor.cores", "spark.executor.memory",
        "spark.executorEnv.PYTHONPATH")}
    server = ConnectServer(str(tmp_path), spark_autoscale.sparkContext.master, confs=autoscaling)
    try:
        done = subprocess.run([sys.executable, "-c", CONNECT_RUN, server.url], capture_output=True, text=True,
                              timeout=240, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT [1.0, 1.0]" in done.stdout  # two ranks, one ring: 0 + 1 on each
