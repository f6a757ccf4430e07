"""SparkRingEstimator / SparkRingModel end to end on real Spark."""
import os
import subprocess
import sys
import threading
import time

import est_helpers as H
import pytest
import torch
from leftovers import ctrl_c_when_ranks_run, wait_no_workers
from paths import ROOT
from pyspark.ml import Pipeline
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import StandardScaler, VectorAssembler
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from waiting import wait_until

from sparkring import RankFailedError, SparkRingEstimator, SparkRingModel, Store


def _estimator(store, **kw):
    params = dict(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=4,
                  numProc=2, seed=3, store=store, verbose=0)
    params.update(kw)
    return SparkRingEstimator(**params)


def _assert_same_weights(a, b, atol=1e-5):
    sa, sb = a.getModel().state_dict(), b.getModel().state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=atol, rtol=0)


@pytest.fixture
def store(tmp_path):
    return Store(str(tmp_path / "store"))


@pytest.mark.compat
def test_fit_trains_a_classifier_and_transform_adds_spark_ml_columns(spark, store):
    df = H.classification_df(spark)
    began = time.perf_counter()
    model = _estimator(store, metrics=["accuracy"], validation=0.2).fit(df)
    wall = time.perf_counter() - began
    assert [h["epoch"] for h in model.history] == [0, 1, 2, 3]
    # where the fit's time went: every phase took some, and together they are its wall time
    phases = model.phases
    assert min(phases.plan, phases.launch, phases.first_step, phases.epochs, phases.result) > 0
    assert 0.9 * wall < phases.total <= wall and model.copy().phases == phases
    assert model.history[-1]["loss"] < model.history[0]["loss"]
    assert {"accuracy", "val_loss", "val_accuracy"} <= set(model.history[-1])
    out = model.transform(df)
    assert set(out.columns) == {"id", "features", "label", "prediction", "probability", "rawPrediction"}
    assert dict(out.dtypes)["prediction"] == "double"
    rows = out.collect()
    assert len(rows) == 480
    acc = sum(r.prediction == r.label for r in rows) / len(rows)
    assert acc > 0.9
    assert abs(sum(rows[0].probability) - 1.0) < 1e-6 and len(rows[0].rawPrediction) == 3
    # the prediction is the argmax of the module's own output
    net = model.getModel().eval()
    with torch.no_grad():
        logits = net(torch.tensor([list(rows[0].features)], dtype=torch.float32))
    assert rows[0].prediction == float(logits.argmax())
    assert os.path.exists(store.model_path(model.getOrDefault("runId"), "model.safetensors"))
    assert not os.path.exists(store.data_path(model.getOrDefault("runId")))  # keepData=False


def test_regression_on_a_list_of_numeric_columns_with_sample_weights(spark, store):
    df = H.regression_df(spark).withColumn("w", __import__("pyspark.sql.functions", fromlist=["lit"]).lit(1.0))
    torch.manual_seed(0)
    est = SparkRingEstimator(model=torch.nn.Linear(2, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                             loss="mse", featuresCol=["a", "b"], labelCol="y", sampleWeightCol="w",
                             batchSize=20, epochs=15, numProc=2, store=store, verbose=0)
    model = est.fit(df)
    w = model.getModel().weight.detach().flatten().tolist()
    assert w == pytest.approx([2.0, -3.0], abs=0.05)
    out = model.transform(df)
    assert dict(out.dtypes)["prediction"] == "double"
    row = out.orderBy("id").first()
    assert row.prediction == pytest.approx(row.y, abs=0.1)


def test_ctrl_c_during_fit_stops_its_ranks_and_the_next_fit_works(spark, store):
    df = H.classification_df(spark)
    ctrl_c_when_ranks_run(2)
    with pytest.raises(KeyboardInterrupt):
        _estimator(store, epochs=2000, runId="interrupted").fit(df)
    assert wait_no_workers(10) == []
    model = _estimator(store, epochs=1, runId="after-interrupt").fit(df)
    assert [h["epoch"] for h in model.history] == [0]


def test_regression_shape_mismatch_names_both_shapes(spark, store):
    df = H.regression_df(spark)
    est = SparkRingEstimator(model=torch.nn.Linear(2, 3), optimizer=H.adam, loss="mse", featuresCol=["a", "b"],
                             labelCol="y", batchSize=10, epochs=1, numProc=2, store=store, verbose=0)
    with pytest.raises(RankFailedError, match=r"model output shape \(10, 3\) does not match label shape \(10,\)"):
        est.fit(df)


def test_callbacks_run_on_rank_zero_and_early_stopping_stops_every_rank(spark, store, tmp_path):
    df = H.classification_df(spark)
    log = tmp_path / "callback.log"
    est = _estimator(store, epochs=30, callbacks=[H.RecordEpochs(str(log))],
                     earlyStopping={"monitor": "loss", "patience": 0, "min_delta": 10.0})
    model = est.fit(df)
    lines = log.read_text().splitlines()
    # min_delta=10 makes every epoch after the first "no better": stop after epoch 1
    assert [h["epoch"] for h in model.history] == [0, 1]
    assert lines[0] == "begin" and lines[-1] == "end 2"
    assert len({line.split("pid")[1] for line in lines if "pid" in line}) == 1  # one process: rank 0
    assert [h["from_callback"] for h in model.history] == [0, 10]  # callbacks may add to the logs


def test_progress_reaches_the_driver_while_training_runs(spark, store, tmp_path, capsys):
    df = H.classification_df(spark)
    est = _estimator(store, epochs=3, verbose=1, callbacks=[H.RecordEpochs(str(tmp_path / "l"), sleep=1.5)])
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("m", est.fit(df)))
    t.start()
    out = []

    def first_epoch_line_or_the_end() -> bool:
        out.append(capsys.readouterr().out)
        return "epoch 1/3" in "".join(out) or not t.is_alive()

    wait_until(first_epoch_line_or_the_end, timeout=300, every=0.1)
    during = "epoch 1/3" in "".join(out) and t.is_alive()
    t.join()
    seen = "".join(out) + capsys.readouterr().out
    assert during, "the first epoch line only arrived after fit() returned"
    assert "epoch 3/3  loss=" in seen
    est.setVerbose(0).setRunId("quiet")
    est.setCallbacks(None).fit(df)
    assert "epoch 1/3" not in capsys.readouterr().out


@pytest.fixture(scope="module")
def retried_reference(tmp_path_factory):
    """One uninterrupted fit that every retried fit of this module is compared with: made on first
    use in the local[2,3] session (the session exists only inside a test), with its DataFrame and
    store, whose prepared data the retried fits reuse."""
    return {"store": Store(str(tmp_path_factory.mktemp("retried") / "store"))}


def _reference_fit(cache, spark):
    if "model" not in cache:
        cache["df"] = H.classification_df(spark)
        cache["model"] = _estimator(cache["store"], runId="reference", keepData=True).fit(cache["df"])
    return cache["model"], cache["df"], cache["store"]


@pytest.mark.parametrize("interruption, layout", [
    pytest.param(H.FailOnce, {}, id="a-rank-raises-at-epoch-2", marks=pytest.mark.compat),
    pytest.param(H.KillOnce, {}, id="a-rank-is-killed-at-epoch-2"),
    # the same two ranks as one task: the killed rank's task mate stops, and Spark reruns the task
    pytest.param(H.KillOnce, {"ranksPerTask": 2}, id="a-rank-of-a-two-rank-task-is-killed-at-epoch-2")])
def test_fit_resumes_with_the_uninterrupted_weights_after_spark_retries_the_stage(spark_retry, retried_reference,
                                                                                 tmp_path, interruption, layout):
    reference, df, store = _reference_fit(retried_reference, spark_retry)
    interrupted = _estimator(store, runId=f"retried-{interruption.__name__}-{len(layout)}", keepData=True,
                             callbacks=[interruption(str(tmp_path / "once"), epoch=2)], **layout)
    resumed = interrupted.fit(df)  # Spark retries the barrier stage; training resumes at epoch 2
    assert (tmp_path / "once").exists()
    assert [h["epoch"] for h in resumed.history] == [0, 1, 2, 3]
    _assert_same_weights(resumed, reference, atol=1e-5)


def test_fit_completes_with_the_uninterrupted_weights_after_an_executor_is_lost(spark_cluster, tmp_path):
    store = Store(str(tmp_path / "store"))
    df = H.classification_df(spark_cluster)
    reference = _estimator(store, runId="reference-lost", keepData=True).fit(df)
    executors_before = _executor_ids(spark_cluster)
    lost = _estimator(store, runId="executor-lost", keepData=True,
                      callbacks=[H.KillExecutorOnce(str(tmp_path / "executor-killed"), epoch=1)])
    resumed = lost.fit(df)  # the standalone worker starts a new executor; Spark reruns the stage
    assert (tmp_path / "executor-killed").exists()
    assert _executor_ids(spark_cluster) != executors_before  # one executor really was replaced
    assert [h["epoch"] for h in resumed.history] == [0, 1, 2, 3]
    _assert_same_weights(resumed, reference, atol=1e-5)
    assert wait_no_workers(10) == []


def _executor_ids(spark):
    infos = spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
    return sorted(f"{infos[i].host()}:{infos[i].port()}" for i in range(len(infos)))


def test_fit_again_with_the_same_run_id_resumes_after_a_failed_fit(spark, store, tmp_path):
    df = H.classification_df(spark)
    reference = _estimator(store, runId="ref2", keepData=True).fit(df)
    with pytest.raises(RankFailedError, match="injected failure at epoch 2"):
        _estimator(store, runId="again", callbacks=[H.FailOnce(str(tmp_path / "m"), epoch=2)]).fit(df)
    ckpts = sorted(os.listdir(store.checkpoint_path("again")))
    assert ckpts == ["epoch-00000.pt", "epoch-00001.pt"]
    resumed = _estimator(store, runId="again").fit(df)
    assert [h["epoch"] for h in resumed.history] == [0, 1, 2, 3]
    _assert_same_weights(resumed, reference, atol=1e-5)


@pytest.mark.compat
def test_model_and_estimator_save_and_load_round_trip(spark, store, tmp_path):
    df = H.classification_df(spark)
    est = _estimator(store, epochs=2, metrics={"first": H.first_value})
    model = est.fit(df)
    model.write().overwrite().save(f"file:{tmp_path / 'model'}")  # Hadoop's spelling, as Spark users write it
    assert (tmp_path / "model" / "metadata" / "part-00000").is_file()  # Spark's layout, where the path says
    loaded = SparkRingModel.load(str(tmp_path / "model"))
    assert loaded.history == model.history
    a = [r.probability for r in model.transform(df).orderBy("id").collect()]
    b = [r.probability for r in loaded.transform(df).orderBy("id").collect()]
    assert a == b
    est.write().overwrite().save(str(tmp_path / "est"))
    est2 = SparkRingEstimator.load(str(tmp_path / "est"))
    assert est2.getBatchSize() == 16 and est2.getLoss() == "cross_entropy"
    assert isinstance(est2.getOrDefault("model"), torch.nn.Module)


@pytest.mark.compat
def test_pipeline_with_assembler_and_scaler_fits_saves_and_loads(spark, store, tmp_path):
    df = H.regression_df(spark).withColumn("label", (__import__("pyspark.sql.functions", fromlist=["col"])
                                                     .col("y") > 0.5).cast("double"))
    pipe = Pipeline(stages=[
        VectorAssembler(inputCols=["a", "b"], outputCol="raw"),
        StandardScaler(inputCol="raw", outputCol="features"),
        SparkRingEstimator(model=H.mlp(d=2, classes=2), optimizer=H.adam, loss="cross_entropy", batchSize=20,
                           epochs=6, numProc=2, store=store, verbose=0)])
    H.assert_pipeline_predicts_and_round_trips(pipe.fit(df), df, tmp_path / "pipe")


def test_cross_validator_fits_each_grid_point_on_data_prepared_once_per_fold_alike_two_at_a_time(spark, store,
                                                                                                 monkeypatch):
    df = H.classification_df(spark, n=240)
    est = _estimator(store, epochs=1, numProc=1)
    grid = ParamGridBuilder().addGrid(est.batchSize, [8, 16]).build()  # two grid points share each fold's data
    prep = sys.modules["sparkring.data.prepare"]
    calls = []
    original = prep._write_partition_fn
    monkeypatch.setattr(prep, "_write_partition_fn", lambda *a, **k: calls.append(1) or original(*a, **k))
    fitted = []
    for parallelism in (1, 2):  # 2: the grid points' fits run at once, each its own barrier stage
        cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=1, parallelism=parallelism,
                            evaluator=MulticlassClassificationEvaluator(metricName="accuracy"))
        fitted.append(cv.fit(df))
        assert len(calls) == 3 * parallelism  # one prepare per fold, one for the final refit
    assert os.listdir(store.path("runs")) and not any(
        os.path.exists(store.data_path(r)) for r in os.listdir(store.path("runs")))
    one, two = fitted
    assert two.avgMetrics == pytest.approx(one.avgMetrics, abs=1e-9)
    _assert_same_weights(one.bestModel, two.bestModel)
    assert two.bestModel.transform(df).count() == 240


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.skipif(not __import__("pyspark").__version__.startswith("3."),
                    reason="pyspark 4: tests/integration/test_standalone.py submits it to a standalone cluster")
def test_spark_submit_digits_example_on_local_cluster():
    import pyspark

    submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = os.path.join(ROOT, "examples", "out")
    proc = subprocess.run([submit, "--master", "local-cluster[2,1,1024]", "--conf", "spark.driver.host=127.0.0.1",
                           "--conf", "spark.executor.memory=768m", os.path.join(ROOT, "examples", "digits.py"),
                           "--epochs", "10", "--out", out], capture_output=True, text=True, env=env, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    acc = float(proc.stdout.split("held-out accuracy:")[1].split()[0])
    assert acc >= 0.95
    assert "identical predictions: True" in proc.stdout
    assert os.path.getsize(os.path.join(out, "digits_loss.png")) > 1000


def test_steps_per_epoch_linear_lr_scaling_and_multi_output_regression(spark, store):
    import io

    df = H.regression_df(spark)
    torch.manual_seed(0)
    est = SparkRingEstimator(model=torch.nn.Linear(2, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                             loss=lambda out, y: ((out - y.reshape(-1, 1)) ** 2).mean(), featuresCol=["a", "b"],
                             labelCol="y", batchSize=10, epochs=2, numProc=2, trainStepsPerEpoch=3,
                             learningRateScaling="linear", store=store, runId="scaled", verbose=0)
    model = est.fit(df)
    ckpt = torch.load(io.BytesIO(store.read_bytes(store.checkpoint_path("scaled", "epoch-00001.pt"))),
                      weights_only=True)
    assert ckpt["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.2)  # 0.1 x 2 ranks
    assert ckpt["optimizer"]["state"] == {}  # plain SGD
    out = model.transform(df)
    assert dict(out.dtypes)["prediction"] == "array<double>"
    assert len(out.first().prediction) == 2


@pytest.mark.compat
def test_transform_works_on_vector_columns_read_back_from_parquet(spark, store, tmp_path):
    df = H.classification_df(spark, n=200)
    model = _estimator(store, epochs=1).fit(df)
    df.write.parquet(str(tmp_path / "in.parquet"))
    from_parquet = spark.read.parquet(str(tmp_path / "in.parquet"))
    rows = model.transform(from_parquet).orderBy("id").collect()
    expected = model.transform(df).orderBy("id").collect()
    assert [r.prediction for r in rows] == [r.prediction for r in expected]


def test_rank_zero_writes_tensorboard_scalars_to_the_run_logs(spark, store):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    df = H.classification_df(spark, n=200)
    _estimator(store, epochs=3, runId="board", validation=0.2).fit(df)
    acc = EventAccumulator(store.logs_path("board"))
    acc.Reload()
    assert {"loss", "val_loss"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [0, 1, 2]


def test_non_finite_loss_raises_training_error_keeping_the_last_good_checkpoint(spark, store):
    from sparkring import TrainingError
    from sparkring.trainer.checkpoints import FILE, listing

    df = H.classification_df(spark)  # 480 rows: 15 steps of 16 per rank and epoch
    est = _estimator(store, model=H.NaNAt(rank=1, calls=[15 + 2]), runId="nan-run", epochs=3)
    with pytest.raises(TrainingError, match=r"non-finite loss nan at epoch 1, step 2 on rank 1") as info:
        est.fit(df)
    assert info.value.rank == 1
    assert [c.name for c in listing(store, "nan-run", FILE)] == ["epoch-00000.pt"]
    resumed = _estimator(store, model=H.NaNAt(rank=1, calls=[]), runId="nan-run", epochs=3).fit(df)
    assert [h["epoch"] for h in resumed.history] == [0, 1, 2]


def test_skip_step_skips_non_finite_updates_on_every_rank_and_counts_them(spark, store):
    df = H.classification_df(spark)
    model = _estimator(store, model=H.NaNAt(rank=1, calls=[3, 20]), onNonFinite="skip_step", epochs=2).fit(df)
    assert [h["skipped_steps"] for h in model.history] == [1, 1]
    assert all(torch.isfinite(p).all() for p in model.getModel().parameters())
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in model.history)
