"""A user's own PyTorch Lightning Trainer across the ranks of sparkring.run() (its DDP, our layout)."""

import lightning_fns
import numpy as np
import pytest
import torch
from pyspark.sql.functions import col

from sparkring import ConfigurationError, RankFailedError, SparkRingEstimator, Store, run

pytest.importorskip("pytorch_lightning")


@pytest.mark.compat
def test_a_lightning_trainer_inside_run_trains_like_one_process_on_the_whole_batches(spark):
    expected = lightning_fns.reference()
    results = run(lightning_fns.train_with_trainer, num_proc=2)
    assert [(r["rank"], r["world"], r["steps"]) for r in results] == [(0, 2, 8), (1, 2, 8)]
    for r in results:
        for key, value in expected.items():
            torch.testing.assert_close(r["state"][key], value, atol=1e-6, rtol=0)


def test_a_trainer_layout_that_does_not_match_the_ranks_is_refused_with_the_fix(spark):
    with pytest.raises(RankFailedError, match=r"Trainer\(devices=1, num_nodes=2\) does not match how sparkring "
                                              r"placed the ranks: 2 on this host, 1 host\(s\)"):
        run(lightning_fns.train_with_trainer, kwargs={"devices": 1, "num_nodes": 2}, num_proc=2)


# -- a LightningModule as the estimator's model --------------------------------------------------
def _regression_df(spark, n=256):
    from pyspark.ml.linalg import Vectors

    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 2, generator=g)
    y = 2 * x[:, 0] - x[:, 1] + 0.1 * torch.randn(n, generator=g)
    rows = [(i, Vectors.dense(x[i].tolist()), float(y[i])) for i in range(n)]
    return spark.createDataFrame(rows, ["id", "features", "label"]).repartition(2, "id")


@pytest.mark.compat
def test_estimator_trains_a_lightning_module_as_it_trains_the_same_plain_module(spark, tmp_path):
    import lightning_modules as M

    df = _regression_df(spark)
    common = dict(batchSize=8, epochs=2, numProc=2, seed=5, validation=0.25, verbose=0,
                  store=Store(str(tmp_path / "store")))
    plain = SparkRingEstimator(model=M.regression_net(), optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
                               loss="mse", **common).fit(df)
    lit = SparkRingEstimator(model=M.Regression(), **common).fit(df)
    for a, b in zip(plain.getModel().state_dict().values(), lit.getModel().state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    timing = {"samples_per_second", "state_bytes", "grad_bytes", "num_proc"} | {
        f"time_{p}{s}" for p in ("data", "compute", "comm", "other") for s in ("", "_slowest")}
    assert [set(h) - timing for h in lit.history] == [{"epoch", "loss", "train_mae", "val_mse"}] * 2
    assert all(timing <= set(h) for h in lit.history)
    for p, q in zip(plain.history, lit.history):
        assert q["loss"] == pytest.approx(p["loss"], abs=1e-6)
        assert q["val_mse"] == pytest.approx(p["val_loss"], abs=1e-6)  # logged by validation_step itself
    # no predict_step: transform runs forward, as for the plain module
    a = {r.id: r.prediction for r in plain.transform(df).collect()}
    b = {r.id: r.prediction for r in lit.transform(df).collect()}
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-5 for k in a)


@pytest.mark.parametrize("interval", ["epoch", "step"])
def test_lightning_lr_schedulers_step_per_epoch_or_per_step_and_predict_step_feeds_transform(spark, tmp_path,
                                                                                              interval):
    import est_helpers as H
    import lightning_modules as M

    df = H.classification_df(spark).withColumn("label", col("label").cast("int"))
    model = SparkRingEstimator(model=M.Classifier(interval), batchSize=16, epochs=3, numProc=2, verbose=0,
                               validation=0.2, store=Store(str(tmp_path / "store"))).fit(df)
    lrs = [h["lr"] for h in model.history]
    if interval == "epoch":
        assert lrs == pytest.approx([0.1, 0.05, 0.025])
    else:
        # after epoch e the scheduler has stepped (e + 1) * steps times: lr = 0.1 * 0.9 ** ((e + 1) * steps)
        steps = np.log(lrs[0] / 0.1) / np.log(0.9)
        assert steps == pytest.approx(round(steps), abs=1e-6) and round(steps) >= 5
        assert lrs == pytest.approx([0.1 * 0.9 ** (round(steps) * e) for e in (1, 2, 3)])
    assert {"loss", "train_acc", "val_loss", "val_acc", "lr"} <= set(model.history[-1])
    assert model.history[-1]["val_acc"] > 0.9
    rows = model.transform(df).collect()
    net = model.getModel().eval()
    with torch.no_grad():
        classes = net(torch.tensor([list(r.features) for r in rows], dtype=torch.float32)).argmax(1)
    assert [r.prediction for r in rows] == [float(c) for c in classes]


def test_a_lightning_module_refuses_the_params_it_decides_itself_and_what_it_cannot_do(spark, tmp_path):
    import est_helpers as H
    import lightning_modules as M

    df = H.classification_df(spark, n=64)
    store = Store(str(tmp_path / "store"))
    with pytest.raises(ConfigurationError, match=r"decides optimizer, loss itself .* drop optimizer=, loss="):
        SparkRingEstimator(model=M.Classifier(), optimizer=H.adam, loss="cross_entropy", store=store).fit(df)
    with pytest.raises(ConfigurationError, match="NoOptimizer defines no configure_optimizers"):
        SparkRingEstimator(model=M.NoOptimizer(), store=store).fit(df)
    with pytest.raises(ConfigurationError, match="automatic_optimization = False"):
        SparkRingEstimator(model=M.Manual(), store=store).fit(df)


def test_a_lightning_fit_resumes_with_its_scheduler_where_the_failed_attempt_left_it(spark_retry, tmp_path):
    import est_helpers as H
    import lightning_modules as M

    df = H.classification_df(spark_retry, n=160).withColumn("label", col("label").cast("int"))
    marker = tmp_path / "failed-once"
    model = SparkRingEstimator(model=M.Classifier("lambda"), batchSize=16, epochs=3, numProc=2, verbose=0,
                               store=Store(str(tmp_path / "store")),
                               callbacks=[H.FailOnce(str(marker), epoch=1)]).fit(df)
    assert marker.exists()  # epoch 1 failed once; Spark retried the stage, which resumed from epoch 0's checkpoint
    assert [h["lr"] for h in model.history] == pytest.approx([0.1, 0.05, 0.025])
