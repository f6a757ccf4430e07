"""Hyperparameter search: a Tuner's trials run as concurrent fits on one session, a diverging one
is pruned at an epoch's end, a failing one is recorded and the study goes on, each trial is a
nested MLflow run, and a tuner started again with the same study name finishes the study without
fitting the finished trials again. Real Spark, real Parquet, real processes."""
import sys

import mlflow
import pytest
import tune_fns as T
from mlflow.tracking import MlflowClient

from sparkring import ConfigurationError, SparkRingEstimator, Store
from sparkring.tune import Tuner

pytestmark = pytest.mark.slow


def _overlapping_classes(spark, n=192, seed=0):
    """Classes whose points overlap: a rate that is far too high makes confident mistakes (a large
    validation loss), where separable classes would be learned at any rate."""
    import numpy as np
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, size=n)
    x = rng.normal(0, 0.7, size=(3, 8))[labels] + rng.normal(0, 1, size=(n, 8))
    rows = [(i, Vectors.dense(x[i]), float(labels[i])) for i in range(n)]
    return spark.createDataFrame(rows, ["id", "features", "label"]).repartition(2, "id")


def _estimator(store, **kw):
    params = dict(model=T.mlp, optimizer=T.adam_at, loss="cross_entropy", batchSize=16, epochs=4, numProc=1,
                  validation=0.25, store=store, verbose=0, seed=1)
    params.update(kw)
    return SparkRingEstimator(**params)


@pytest.fixture
def tracking(tmp_path):
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    mlflow.set_experiment(experiment_id=mlflow.create_experiment("tune", artifact_location=(tmp_path / "art").as_uri()))
    try:
        yield MlflowClient()
    finally:
        while mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(before)


def test_six_trials_two_at_a_time_prune_a_diverging_rate_record_a_failure_and_keep_the_best(spark, tmp_path,
                                                                                             tracking, monkeypatch):
    df = _overlapping_classes(spark)
    prep = sys.modules["sparkring.data.prepare"]
    prepared = []
    original = prep._write_partition_fn
    monkeypatch.setattr(prep, "_write_partition_fn", lambda *a, **k: prepared.append(1) or original(*a, **k))
    est = _estimator(Store(str(tmp_path / "store")), mlflowLogging="on")
    tuner = Tuner(est, lambda trial: T.rates_in_order(trial, failing=5), metric="val_loss", trials=6,
                  concurrentTrials=2, studyName="rates")
    result = tuner.fit(df)
    rows = {r.number: r for r in result.trials}
    assert sorted(rows) == list(range(6))
    assert len(prepared) == 1  # the data is prepared once for every trial, the first two at once included
    assert [rows[n].state for n in (0, 1, 2)] == ["COMPLETE"] * 3
    # the first two ran side by side
    first, second = (result.study.trials[n] for n in (0, 1))
    assert first.datetime_start < second.datetime_complete and second.datetime_start < first.datetime_complete
    # ASHA compares trials once one has finished: a rate that diverges stops before its last epoch
    pruned = [r for r in rows.values() if r.state == "PRUNED"]
    assert pruned and all(r.params["lr"] >= 30 and r.epochs < 4 for r in pruned)
    assert rows[5].state == "FAIL" and "forward fails on purpose" in rows[5].error
    complete = [r for r in rows.values() if r.state == "COMPLETE"]
    best = min(complete, key=lambda r: r.metric)
    assert result.best_params == best.params and result.best_params["lr"] < 1
    assert result.best_model.history[-1]["val_loss"] == pytest.approx(best.metric)
    assert result.best_model.transform(df).count() == 192
    # MLflow: one parent run, a nested run per trial with its state and per-epoch figures
    experiment = tracking.get_experiment_by_name("tune").experiment_id
    [parent] = tracking.search_runs([experiment], filter_string="tags.`mlflow.runName` = 'rates'")
    children = tracking.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    states = {int(c.data.tags["sparkring.tune.trial"]): c.data.tags["sparkring.tune.state"] for c in children}
    assert states == {n: r.state for n, r in rows.items()}
    done = [c for c in children if c.data.tags["sparkring.tune.state"] == "COMPLETE"]
    assert all(len(tracking.get_metric_history(c.info.run_id, "val_loss")) == 4 for c in done)


def test_a_tuner_started_again_with_the_same_study_name_finishes_the_study_without_refitting(spark, tmp_path):
    df = _overlapping_classes(spark)
    est = _estimator(Store(str(tmp_path / "store")), epochs=2)
    space = T.interrupted_at(str(tmp_path / "interrupted"), number=3)
    with pytest.raises(KeyboardInterrupt):
        Tuner(est, space, trials=5, concurrentTrials=1, pruner="none", studyName="resumable").fit(df)
    again = Tuner(est, space, trials=5, concurrentTrials=1, pruner="none", studyName="resumable")
    result = again.fit(df)
    states = [(t.number, t.state.name) for t in result.study.trials]
    # trials 0-2 kept (not fitted again: each still has its own two epochs), 3 was interrupted, 4-5 ran now
    assert states == [(0, "COMPLETE"), (1, "COMPLETE"), (2, "COMPLETE"), (3, "FAIL"), (4, "COMPLETE"),
                      (5, "COMPLETE")]
    assert result.study.trials[3].user_attrs == {"interrupted": True}
    best = min((t for t in result.study.trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert result.best_params == best.params
    assert result.best_model.history[-1]["val_loss"] == pytest.approx(best.value)


def test_what_a_tuner_cannot_run_is_refused_before_any_spark_job(spark, tmp_path):
    from optuna.distributions import FloatDistribution

    est = _estimator(Store(str(tmp_path / "store")))
    with pytest.raises(ConfigurationError, match=r"\['learningRate'\], which are no Params"):
        Tuner(est, {"learningRate": FloatDistribution(1e-4, 1e-1, log=True)})
    with pytest.raises(ConfigurationError, match="validation figure"):
        Tuner(_estimator(Store(str(tmp_path / "store")), validation=0.0), T.rates_in_order)
    with pytest.raises(ConfigurationError, match="pruner='asap'"):
        Tuner(est, T.rates_in_order, pruner="asap")
