"""MLflow tracking of fit() and the fitted model as an MLflow model, against a real tracking
store (SQLite) and artifact directory made by the test."""
import sys

import est_helpers as H
import numpy as np
import pytest
import torch

mlflow = pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402
from pyspark.ml import PipelineModel  # noqa: E402
from pyspark.ml.functions import vector_to_array  # noqa: E402
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder  # noqa: E402

import sparkring.mlflow as srm  # noqa: E402
from sparkring import ConfigurationError, SparkRingEstimator, Store, run  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    """A fresh SQLite tracking store and artifact directory; MLflow's URI is restored afterwards."""
    root = tmp_path_factory.mktemp("mlflow")
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{root}/mlflow.db")
    experiment_id = mlflow.create_experiment("sparkring-tests", artifact_location=(root / "artifacts").as_uri())
    mlflow.set_experiment(experiment_id=experiment_id)
    yield experiment_id
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(before)


def _estimator(tmp_path, **kw):
    params = dict(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=3, numProc=2,
                  seed=3, store=Store(str(tmp_path / "store")), verbose=0)
    params.update(kw)
    return SparkRingEstimator(**params)


def _how_this_rank_started():
    with open("/proc/self/cmdline", "rb") as f:
        return "spawned" if b"sparkring.runner.task.worker" in f.read() else "forked"


def _runs(experiment_id):
    return MlflowClient().search_runs([experiment_id])


@pytest.mark.compat
def test_fit_logs_params_epoch_metrics_loss_curve_and_a_torch_model_for_any_batch(spark, experiment, tmp_path):
    df = H.classification_df(spark)
    with mlflow.start_run() as run:
        model = _estimator(tmp_path, validation=0.2, metrics=["accuracy"]).fit(df)
    client = MlflowClient()
    logged = client.get_run(run.info.run_id)
    assert logged.info.status == "FINISHED"
    assert logged.data.params["epochs"] == "3" and logged.data.params["batchSize"] == "16"
    assert logged.data.params["model"].startswith("Sequential: Sequential(")
    assert logged.data.params["optimizer"] == "function: est_helpers.adam"
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == [0, 1, 2]
        assert [m.value for m in history] == [h[key] for h in model.history]
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "loss_curve.png" in artifacts and "step_time.png" in artifacts

    # the logged torch model takes any batch size and predicts what transform predicts
    rows = df.orderBy("id").limit(7).collect()
    x = torch.tensor([list(r.features) for r in rows], dtype=torch.float32)
    loaded = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    net = model.getModel().eval()
    with torch.no_grad():
        for n in (1, 3, 7):
            torch.testing.assert_close(loaded(x[:n]), net(x[:n]), rtol=0, atol=1e-6)
        logits = loaded(x)
    predicted = {r.id: r.prediction for r in model.transform(df.orderBy("id").limit(7)).collect()}
    assert [predicted[r.id] for r in rows] == [float(i) for i in logits.argmax(1)]
    pyfunc = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    np.testing.assert_allclose(np.asarray(pyfunc.predict(x[:3].numpy())), logits[:3].numpy(), atol=1e-6)


@pytest.mark.compat
def test_logged_model_scores_through_spark_udf_exactly_as_transform(spark, experiment, tmp_path):
    df = H.classification_df(spark, n=240)
    model = _estimator(tmp_path, epochs=2, mlflowLogging="off").fit(df)
    expected = {r.id: (r.prediction, list(r.probability)) for r in model.transform(df).collect()}
    with mlflow.start_run():
        info = srm.log_model(model, "sparkring_model", df=df)
        pipeline_info = srm.log_model(PipelineModel(stages=[model]), "pipeline")

    # spark_udf hands a vector column over as its struct fields: vectors go as arrays
    predict = mlflow.pyfunc.spark_udf(spark, info.model_uri, result_type="double")
    scored = df.withColumn("p", predict(vector_to_array("features"))).select("id", "p").collect()
    assert {r.id: r.p for r in scored} == {k: v[0] for k, v in expected.items()}

    # ranks forked from the Spark workers that ran the UDF start and train: under the old
    # fork (close every inherited descriptor) rank 0's TCPStore lost its libuv signal pipe to a
    # stale close and aborted (SIGABRT)
    started = run(_how_this_rank_started, num_proc=2)
    assert started == ["forked", "forked"]
    again = _estimator(tmp_path, epochs=1, mlflowLogging="off").fit(df)
    assert len(again.history) == 1

    # on pandas: prediction, probability and rawPrediction, by column name
    pdf = df.orderBy("id").limit(20).toPandas()
    pdf["features"] = [v.toArray() for v in pdf.features]
    out = mlflow.pyfunc.load_model(info.model_uri).predict(pdf[["features"]])
    assert list(out.columns) == ["prediction", "probability", "rawPrediction"]
    for i, r in pdf.iterrows():
        assert out.prediction[i] == expected[r.id][0]
        np.testing.assert_allclose(out.probability[i], expected[r.id][1], rtol=0, atol=1e-12)

    # loaded back: the SparkRingModel, and the PipelineModel through MLflow's Spark flavour
    back = srm.load_model(info.model_uri)
    assert {r.id: r.prediction for r in back.transform(df).collect()} == {k: v[0] for k, v in expected.items()}
    assert back.history == model.history
    pipeline = srm.load_model(pipeline_info.model_uri)
    assert isinstance(pipeline, PipelineModel)
    got = {r.id: r.prediction for r in pipeline.transform(df).collect()}
    assert got == {k: v[0] for k, v in expected.items()}


def test_cross_validator_logs_one_child_run_per_grid_point_and_the_best_in_the_parent(spark, experiment, tmp_path):
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    df = H.classification_df(spark, n=240)
    est = _estimator(tmp_path, epochs=2)
    grid = ParamGridBuilder().addGrid(est.batchSize, [8, 30]).build()
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=1,
                        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"))
    with mlflow.start_run() as parent:
        cv_model = cv.fit(df)
    client = MlflowClient()
    children = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.data.tags["sparkring.grid_index"] for c in children) == ["0", "1"]
    for child in children:
        index = int(child.data.tags["sparkring.grid_index"])
        assert child.info.status == "FINISHED"
        assert child.data.params["batchSize"] == str(grid[index][est.batchSize])
        folds = [client.get_metric_history(child.info.run_id, f"fold{k}/loss") for k in (0, 1)]
        assert [sorted(m.step for m in fold) for fold in folds] == [[0, 1], [0, 1]]
        finals = [max(fold, key=lambda m: m.step).value for fold in folds]
        assert child.data.metrics["loss"] == pytest.approx(np.mean(finals), rel=1e-12)
    best = int(np.argmax(cv_model.avgMetrics))
    parent_run = client.get_run(parent.info.run_id)
    assert parent_run.data.params["batchSize"] == str(grid[best][est.batchSize])
    assert [m.step for m in client.get_metric_history(parent.info.run_id, "loss")] == [0, 1]
    assert mlflow.pytorch.load_model(f"runs:/{parent.info.run_id}/model") is not None


def test_nothing_is_logged_when_off_or_without_a_run_and_on_starts_one(spark, experiment, tmp_path, monkeypatch):
    df = H.classification_df(spark, n=160)
    with mlflow.start_run() as run:
        _estimator(tmp_path, epochs=1, mlflowLogging="off").fit(df)
    logged = MlflowClient().get_run(run.info.run_id)
    assert logged.data.params == {} and logged.data.metrics == {}

    before = {r.info.run_id for r in _runs(experiment)}
    _estimator(tmp_path, epochs=1).fit(df)  # auto, no active run
    assert {r.info.run_id for r in _runs(experiment)} == before

    model = _estimator(tmp_path, epochs=1, mlflowLogging="on").fit(df)
    new = [r for r in _runs(experiment) if r.info.run_id not in before]
    assert len(new) == 1 and new[0].info.status == "FINISHED"
    assert new[0].data.metrics["loss"] == model.history[0]["loss"]
    assert mlflow.active_run() is None

    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow now fails, as where it is not installed
    with pytest.raises(ConfigurationError, match=r"mlflowLogging='on' but mlflow is not installed"):
        _estimator(tmp_path, epochs=1, mlflowLogging="on").fit(df)
    with pytest.raises(ConfigurationError, match="mlflowLogging='sometimes'"):
        _estimator(tmp_path, epochs=1, mlflowLogging="sometimes").fit(df)


def test_a_lightning_modules_self_log_figures_reach_mlflow(spark, experiment, tmp_path):
    import lightning_modules as M
    from pyspark.sql.functions import col

    df = H.classification_df(spark, n=160).withColumn("label", col("label").cast("int"))
    with mlflow.start_run() as run:
        model = SparkRingEstimator(model=M.Classifier(), batchSize=16, epochs=2, numProc=2, validation=0.25,
                                   verbose=0, store=Store(str(tmp_path / "store"))).fit(df)
    client = MlflowClient()
    for key in ("loss", "train_acc", "val_loss", "val_acc", "lr"):
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [m.value for m in history] == [h[key] for h in model.history]
    loaded = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    x = torch.randn(3, 8)
    torch.testing.assert_close(loaded(x), model.getModel().eval()(x), rtol=0, atol=1e-6)
