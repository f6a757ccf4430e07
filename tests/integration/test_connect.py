"""run(), fit(), transform(), save/load and the CLI on a real Spark Connect session (a server
process on 127.0.0.1 with master local[2,2]), live and with streaming switched off."""
import os
import subprocess
import sys
import time

import est_helpers as H
import psutil
import pytest
import rank_fns
import torch
from paths import ROOT
from pyspark.ml import Pipeline
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import functions as F
from waiting import wait_until

from sparkring import RankFailedError, RankTimeoutError, SparkRingEstimator, Store, run

pytestmark = pytest.mark.connect


def _no_rank_processes(timeout=15):
    alive = []

    def none_alive() -> bool:
        alive[:] = [p.pid for p in psutil.process_iter(["name", "cmdline"])
                    if (p.info.get("name") or "").startswith("sparkring-r")
                    or "sparkring.runner.task.worker" in (p.info.get("cmdline") or [])]
        return not alive

    wait_until(none_alive, timeout=timeout, every=0.2)
    return alive


def test_connect_session_has_no_spark_context_and_run_returns_collectives_by_rank(spark_connect):
    from sparkring.runner.driver.session import is_connect

    assert is_connect(spark_connect)
    results = run(rank_fns.collectives_tour, num_proc=2, spark=spark_connect)
    assert [r["rank"] for r in results] == [0, 1]
    odd = torch.arange(7, dtype=torch.float32)
    for r in results:
        torch.testing.assert_close(r["avg_odd"], odd + 0.5)
        torch.testing.assert_close(r["bcast"], torch.tensor([11]))
        assert r["gobj"] == [("rank", 0), ("rank", 1)]
        assert r["gather"].shape == (3, 2)
    assert _no_rank_processes() == []


@pytest.mark.parametrize("stream", [True, False], ids=["live", "detached"])
def test_rank_failure_on_connect_names_the_rank_with_its_traceback(spark_connect, stream):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run(rank_fns.fail_on_rank, args=(1,), num_proc=2, stream=stream, spark=spark_connect, verbose=0)
    assert info.value.rank == 1
    assert "ValueError: boom on purpose in rank 1" in info.value.remote_traceback
    # two stage attempts (the server's), each stopped as soon as rank 1 fails
    assert time.monotonic() - started < 60
    assert _no_rank_processes() == []


@pytest.mark.parametrize("stream", [True, False], ids=["live", "detached"])
def test_hung_rank_on_connect_gives_a_timeout_naming_it(spark_connect, stream):
    with pytest.raises(RankTimeoutError) as info:
        run(rank_fns.sleep_on_rank, args=(0,), num_proc=2, timeout=2, stream=stream, spark=spark_connect,
            verbose=0)
    assert info.value.ranks == [0]
    assert "in sleep_on_rank" in str(info.value)
    assert _no_rank_processes() == []


def test_detached_run_returns_results_and_replays_output_and_events_at_the_end(spark_connect, capsys, tmp_path):
    got = []
    results = run(rank_fns.report_events, args=(3,), num_proc=2, stream=False, spark=spark_connect,
                  on_event=lambda rank, payload: got.append((rank, payload["i"])))
    assert results == [3, 3]
    assert sorted(got) == [(r, i) for r in (0, 1) for i in range(3)]
    # task 0 hosts the relay: it must stay until the slower rank is done
    assert run(rank_fns.rank_one_finishes_later, args=(3,), num_proc=2, stream=False, spark=spark_connect) == [0, 1]
    flag = tmp_path / "flag"
    flag.write_text("go")
    assert run(rank_fns.print_and_wait, args=(str(flag), 5), num_proc=2, stream=False, verbose=2,
               spark=spark_connect) == [True, True]
    out = capsys.readouterr().out
    assert "[0] rank 0 says hello" in out and "[1] rank 1 says hello" in out


def _pipeline(store, **kw):
    return Pipeline(stages=[
        VectorAssembler(inputCols=["a", "b"], outputCol="features"),
        SparkRingEstimator(model=H.mlp(d=2, classes=2, dropout=0.0), optimizer=H.adam, loss="cross_entropy",
                           batchSize=20, epochs=6, numProc=2, store=store, verbose=0, **kw)])


def test_pipeline_fit_transform_save_load_on_connect(spark_connect, tmp_path):
    df = H.regression_df(spark_connect).withColumn("label", (F.col("y") > 0.5).cast("double"))
    fitted = _pipeline(Store(str(tmp_path / "store"))).fit(df)
    preds = H.assert_pipeline_predicts_and_round_trips(fitted, df, tmp_path / "pipe", column="probability")
    assert {"prediction", "probability", "rawPrediction"} <= set(preds.columns)


def test_fit_with_streaming_off_prints_epoch_lines_when_training_ends(spark_connect, tmp_path, capsys):
    df = H.classification_df(spark_connect)
    model = SparkRingEstimator(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=2,
                               numProc=2, store=Store(str(tmp_path / "store")), streamLogs=False).fit(df)
    assert [h["epoch"] for h in model.history] == [0, 1]
    out = capsys.readouterr().out
    assert "epoch 1/2  loss=" in out and "epoch 2/2  loss=" in out


def test_fit_on_connect_resumes_from_the_last_checkpoint_after_a_stage_retry(spark_connect, tmp_path):
    df = H.classification_df(spark_connect)
    store = Store(str(tmp_path / "store"))
    common = dict(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=4, numProc=2,
                  seed=3, store=store, verbose=0, keepData=True)
    reference = SparkRingEstimator(runId="reference", **common).fit(df)
    resumed = SparkRingEstimator(runId="retried", callbacks=[H.FailOnce(str(tmp_path / "failed-once"), epoch=2)],
                                 **common).fit(df)
    assert (tmp_path / "failed-once").exists()
    assert [h["epoch"] for h in resumed.history] == [0, 1, 2, 3]
    for k, v in reference.getModel().state_dict().items():
        torch.testing.assert_close(resumed.getModel().state_dict()[k], v, atol=1e-5, rtol=0)


def test_cli_runs_a_script_over_spark_connect(connect_url):
    script = os.path.join(ROOT, "examples", "hello_ring.py")
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    ok = subprocess.run([sys.executable, "-m", "sparkring", "run", "-np", "2", "--remote", connect_url, script,
                         "--steps", "2"], capture_output=True, text=True, env=env, timeout=180)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "weights identical on all ranks: True" in ok.stdout
    env["SPARK_REMOTE"] = connect_url
    quiet = subprocess.run([sys.executable, "-m", "sparkring", "run", "-np", "2", "--no-stream", script,
                            "--steps", "2"], capture_output=True, text=True, env=env, timeout=180)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "weights identical on all ranks: True" in quiet.stdout


def test_cross_validator_on_connect_and_the_best_model_saves_over_an_existing_path(spark_connect, tmp_path):
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    from sparkring import SparkRingModel

    df = H.classification_df(spark_connect, n=240)
    est = SparkRingEstimator(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=1,
                             numProc=2, store=Store(str(tmp_path / "store")), verbose=0)
    grid = ParamGridBuilder().addGrid(est.batchSize, [8, 16]).build()
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=1,
                        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"))
    cv_model = cv.fit(df)
    assert len(cv_model.avgMetrics) == 2 and max(cv_model.avgMetrics) > 0.5
    path = str(tmp_path / "best")
    os.makedirs(path)
    (tmp_path / "best" / "stale").write_text("left from an earlier save")
    cv_model.bestModel.write().overwrite().save(path)
    assert not (tmp_path / "best" / "stale").exists()
    loaded = SparkRingModel.load(path)
    assert loaded.history == cv_model.bestModel.history


def test_unreachable_client_is_detected_and_the_run_completes_detached(spark_connect, monkeypatch, capsys):
    from sparkring.runner.channel import DriverChannel

    launch_module = sys.modules["sparkring.runner.driver.launch"]  # the package exports a function of that name

    class Unreachable(DriverChannel):
        """Listens nowhere: every task's connection attempt is refused, as behind NAT."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._sock.close()

    monkeypatch.setattr(launch_module, "DriverChannel", Unreachable)
    started = time.monotonic()
    assert run(rank_fns.whoami, num_proc=2, spark=spark_connect, verbose=2)[1]["rank"] == 1
    with pytest.raises(RankFailedError) as info:
        run(rank_fns.fail_on_rank, args=(0,), num_proc=2, spark=spark_connect, verbose=0)
    assert info.value.rank == 0 and "boom on purpose in rank 0" in info.value.remote_traceback
    assert time.monotonic() - started < 90
    assert _no_rank_processes() == []


def test_connect_session_refuses_more_ranks_than_slots_and_unscheduled_gpus_before_any_job(spark_connect):
    from sparkring import ConfigurationError

    with pytest.raises(ConfigurationError, match="num_proc=3 is larger than the 2 concurrent task slots"):
        run(rank_fns.whoami, num_proc=3, spark=spark_connect)
    with pytest.raises(ConfigurationError, match="use_gpu=True in local mode but the driver has no GPUs"):
        run(rank_fns.whoami, num_proc=2, use_gpu=True, spark=spark_connect)


def test_torch_distributor_runs_a_ddp_function_on_connect(spark_connect):
    import ddp_fns

    from sparkring import TorchDistributor

    out = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark_connect).run(
        ddp_fns.spark_style_train, 0.1)
    assert isinstance(out, float)
    local = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(ddp_fns.spark_style_train, 0.1)
    assert out == local  # the same training, launched by a Connect stage or by local processes


def test_a_parquet_scan_on_connect_is_prepared_as_the_plan_is_not_at_hand(spark_connect, tmp_path):
    from sparkring.data import prepare

    path = str(tmp_path / "scan")
    spark_connect.range(40).select(F.col("id").cast("double").alias("label"), F.array(F.col("id").cast("float"))
                                   .alias("x")).write.parquet(path)
    ds = prepare(spark_connect.read.parquet(path), Store(str(tmp_path / "store")), columns=["x", "label"],
                 in_place=True)
    assert not ds.in_place and ds.num_rows() == 40 and ds.shapes["x"] == [1]
