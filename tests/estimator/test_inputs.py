"""Model inputs on real Spark: several inputs, int64 ids, shapes, bytes + transformFn, several heads."""
import os

import input_helpers as H
import numpy as np
import pytest
import torch

from sparkring import ConfigurationError, RankFailedError, SparkRingEstimator, SparkRingModel, Store
from sparkring.data import DataError, prepare

pytestmark = pytest.mark.slow


@pytest.fixture
def store(tmp_path):
    return Store(str(tmp_path / "store"))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def _recommender(store, **kw):
    params = dict(model=H.MatrixFactorization(), optimizer=_sgd, loss="mse",
                  modelInputs=["user", "item", ["age", "income"]], labelCol="rating", batchSize=32, epochs=3,
                  numProc=2, seed=1, store=store, verbose=0)
    params.update(kw)
    return SparkRingEstimator(**params)


def _runs_left(store):
    root = os.path.join(store.root, "runs")
    return [] if not os.path.exists(root) else [p for p in os.listdir(root)
                                                if os.listdir(os.path.join(root, p))]


def _jobs(spark):
    return len(spark.sparkContext.statusTracker().getJobIdsForGroup(None))


@pytest.mark.compat
def test_recommender_gets_int64_ids_and_float_dense_inputs_and_transform_feeds_it_the_same_way(spark, store):
    df = H.ratings_df(spark)
    model = _recommender(store, epochs=6).fit(df)
    losses = [h["loss"] for h in model.history]
    assert losses[-1] < 0.7 * losses[0]
    out = model.transform(df).select("user", "item", "age", "income", "rating", "prediction").toPandas()
    net = model.getModel().eval()
    with torch.no_grad():
        expected = net(torch.tensor(out["user"].to_numpy(), dtype=torch.int64),
                       torch.tensor(out["item"].to_numpy(), dtype=torch.int64),
                       torch.tensor(out[["age", "income"]].to_numpy(), dtype=torch.float32)).reshape(-1)
    np.testing.assert_allclose(out["prediction"].to_numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
    assert _runs_left(store) == [next(iter(os.listdir(os.path.join(store.root, "runs"))))]  # one run dir


def test_dict_model_inputs_are_passed_as_keyword_arguments(spark, store):
    df = H.ratings_df(spark)
    est = _recommender(store, model=H.KeywordTower(), modelInputs={"ids": "user", "extra": ["age"]}, epochs=1)
    model = est.fit(df)
    assert model.transform(df).select("prediction").count() == df.count()


def test_sparse_embedding_gradients_train_like_dense_ones(spark, store):
    df = H.ratings_df(spark)
    dense = _recommender(store, model=H.MatrixFactorization(sparse=False), epochs=2).fit(df)
    sparse = _recommender(store, model=H.MatrixFactorization(sparse=True), epochs=2).fit(df)
    for name, value in dense.getModel().state_dict().items():
        torch.testing.assert_close(sparse.getModel().state_dict()[name], value, atol=1e-6, rtol=0)


def test_input_shapes_reshape_flat_pixels_and_nested_arrays_keep_their_shape(spark, store):
    df = H.images_df(spark)
    flat = SparkRingEstimator(model=H.TinyConv(), optimizer=_sgd, loss="cross_entropy", featuresCol="flat",
                              inputShapes=[1, 4, 4], batchSize=20, epochs=3, numProc=2, store=store,
                              verbose=0).fit(df)
    assert flat.history[-1]["loss"] < flat.history[0]["loss"]
    preds = flat.transform(df).select("prediction", "label").toPandas()
    assert (preds["prediction"] == preds["label"]).mean() > 0.9
    grid = SparkRingEstimator(model=H.GridNet(), optimizer=_sgd, loss="cross_entropy", modelInputs=["grid"],
                              batchSize=20, epochs=1, numProc=2, store=store, verbose=0).fit(df)
    assert grid.featureSpec.column("grid").shape == (4, 4)
    assert grid.transform(df).select("prediction").count() == 400


def test_png_bytes_decoded_by_transform_fn_train_a_conv_net(spark, store):
    df = H.images_df(spark)
    model = SparkRingEstimator(model=H.TinyConv(), optimizer=_sgd, loss="cross_entropy",
                               modelInputs={"x": "png"}, inputShapes={"x": [1, 4, 4]}, transformFn=H.decode_png,
                               readerWorkers=1, batchSize=20, epochs=4, numProc=2, store=store, verbose=0).fit(df)
    preds = model.transform(df).select("prediction", "label").toPandas()
    assert (preds["prediction"] == preds["label"]).mean() > 0.9
    inverted = model.copy({model.transformFnInference: H.decode_png_inverted}).transform(df)
    assert (inverted.select("prediction", "label").toPandas().eval("prediction == label")).mean() < 0.6


def test_reader_workers_run_the_transform_in_other_processes_in_the_same_order(spark, store):
    df = H.images_df(spark, rows=200)
    ds = prepare(df, store, columns=["id", "png"])
    inline = list(ds.batches(16, shuffle=True, seed=2, transform=H.decode_png_with_pid, workers=0))
    pooled = list(ds.batches(16, shuffle=True, seed=2, transform=H.decode_png_with_pid, workers=2))
    assert [b["id"].tolist() for b in pooled] == [b["id"].tolist() for b in inline]
    for a, b in zip(inline, pooled):
        torch.testing.assert_close(a["png"], b["png"])
    assert {int(p) for b in inline for p in b["pid"]} == {os.getpid()}
    assert os.getpid() not in {int(p) for b in pooled for p in b["pid"]}


def test_two_heads_two_labels_weighted_losses_per_head_history_and_prediction_columns(spark, store):
    df = H.ratings_df(spark)
    model = _recommender(store, model=H.MatrixFactorization(heads=2), labelCol=["rating", "clicked"],
                         loss=["mse", "bce_with_logits"], lossWeights=[1.0, 0.5],
                         predictionCol=["rating_hat", "click_hat"], metrics=["accuracy"], validation=0.2,
                         epochs=2).fit(df)
    last = model.history[-1]
    for key in ("loss", "rating_loss", "clicked_loss", "rating_accuracy", "clicked_accuracy", "val_loss",
                "val_rating_loss", "val_clicked_loss"):
        assert key in last, (key, sorted(last))
    assert last["loss"] == pytest.approx(last["rating_loss"] + 0.5 * last["clicked_loss"], rel=1e-6)
    out = model.transform(df).select("rating_hat", "click_hat").toPandas()
    assert set(out["click_hat"].unique()) <= {0.0, 1.0}
    assert out["rating_hat"].nunique() > 10


@pytest.mark.parametrize("kw,match", [
    ({"modelInputs": ["user", "nope"]}, r"modelInputs names column 'nope' \(input 'nope'\)"),
    ({"modelInputs": ["user", ["age", "income"]], "inputShapes": {"age+income": [3]}},
     r"inputShapes\['age\+income'\]=\[3\] holds 3 elements but column\(s\) \['age', 'income'\] give 2"),
    ({"labelCol": ["rating", "clicked"], "loss": ["mse"]}, r"loss has 1 entries but labelCol names 2"),
    ({"labelCol": ["rating", "clicked"], "loss": ["mse", "mse"], "lossWeights": [1.0]},
     r"lossWeights has 1 entries"),
    ({"modelInputs": {"x": "png"}}, r"column 'png' \(input 'x'\) is binary: pass transformFn="),
])
def test_bad_inputs_are_rejected_before_any_spark_job(spark, store, kw, match):
    df = H.ratings_df(spark)
    if "png" in str(kw):
        df = df.selectExpr("*", "cast('x' as binary) as png")
    before = _jobs(spark)
    with pytest.raises(ConfigurationError, match=match):
        _recommender(store, **kw).fit(df)
    assert _jobs(spark) == before
    assert _runs_left(store) == []


def test_shape_and_ragged_nested_arrays_are_refused_after_prepare_leaving_nothing(spark, store):
    df = H.images_df(spark, rows=40)
    with pytest.raises(DataError, match=r"inputShapes\['flat'\]=\[1, 3, 3\] holds 9 elements but column\(s\) "
                                        r"\['flat'\] give 16 per row"):
        SparkRingEstimator(model=H.TinyConv(), optimizer=_sgd, loss="cross_entropy", featuresCol="flat",
                           inputShapes=[1, 3, 3], numProc=2, store=store, verbose=0).fit(df)
    ragged = spark.createDataFrame([([[1.0, 2.0], [3.0, 4.0]], 0.0), ([[1.0], [2.0, 3.0]], 1.0)],
                                   "grid array<array<double>>, label double")
    with pytest.raises(DataError, match=r"column 'grid' holds arrays of different lengths \(1 to 2\) at "
                                        r"nesting level 2"):
        SparkRingEstimator(model=H.GridNet(), optimizer=_sgd, loss="cross_entropy", featuresCol="grid",
                           numProc=2, store=store, verbose=0).fit(ragged)
    assert _runs_left(store) == []


@pytest.mark.parametrize("fn,match", [
    (H.broken_transform, r"(?s)rank \d failed.*RuntimeError: cannot decode this image"),
    (H.not_a_dict_transform, r"(?s)rank \d failed.*transformFn returned list, not a dict"),
])
def test_transform_fn_failures_reach_the_driver_with_rank_and_traceback(spark, store, fn, match):
    df = H.images_df(spark, rows=80)
    with pytest.raises(RankFailedError, match=match):
        SparkRingEstimator(model=H.TinyConv(), optimizer=_sgd, loss="cross_entropy", modelInputs={"x": "png"},
                           inputShapes={"x": [1, 4, 4]}, transformFn=fn, readerWorkers=1, batchSize=20,
                           numProc=2, store=store, verbose=0).fit(df)


def test_model_errors_name_rank_and_batch_on_the_driver(spark, store):
    df = H.ratings_df(spark)
    with pytest.raises(RankFailedError, match=r"(?s)index out of range.*on rank \d, epoch 0, training batch 0"):
        _recommender(store, model=H.MatrixFactorization(users=10)).fit(df)  # ids up to 59
    with pytest.raises(RankFailedError, match=r"the model returned 1 output\(s\) but labelCol names 2 labels"):
        _recommender(store, model=H.MatrixFactorization(heads=3), labelCol=["rating", "clicked"],
                     loss=["mse", "bce_with_logits"]).fit(df)


@pytest.mark.compat
def test_multi_input_model_saves_and_loads_with_its_feature_spec(spark, store, tmp_path):
    df = H.ratings_df(spark)
    model = _recommender(store, epochs=1).fit(df)
    path = str(tmp_path / "saved")
    model.write().overwrite().save(path)
    loaded = SparkRingModel.load(path)
    assert loaded.featureSpec == model.featureSpec
    a = model.transform(df).select("prediction").toPandas()["prediction"].to_numpy()
    b = loaded.transform(df).select("prediction").toPandas()["prediction"].to_numpy()
    np.testing.assert_allclose(a, b)
