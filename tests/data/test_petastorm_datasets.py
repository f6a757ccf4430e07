"""Training on datasets petastorm wrote (Unischema codec fields), with and without petastorm:
the dataset URL is enough, codec fields arrive decoded, transform() takes the same rows."""
import importlib.util
import os
import shutil

import est_helpers as H
import numpy as np
import pytest
import torch
from paths import DATA

from sparkring import SparkRingEstimator
from sparkring.data import Store, petastorm_codecs, prepare
from sparkring.data.unischema import Codec

pytestmark = pytest.mark.compat  # version-dependent throughout (make test-compat)

FIXTURE = os.path.join(DATA, "petastorm_dataset")  # written by petastorm 0.12.1: data/make_petastorm_dataset.py
CAN_WRITE = all(importlib.util.find_spec(m) is not None for m in ("petastorm", "cv2"))


def _expected():
    with np.load(os.path.join(DATA, "petastorm_expected.npz")) as npz:
        return {k: npz[k] for k in npz.files}


def _fit_and_transform(spark, url, tmp_path, reader):
    df = spark.read.parquet(url)
    est = SparkRingEstimator(model=H.MatAndImage(), optimizer=H.adam, loss="mse", modelInputs=["mat", "img"],
                             labelCol="label", batchSize=4, epochs=2, numProc=2, seed=1, verbose=0,
                             store=Store(str(tmp_path / f"store-{reader}")), reader=reader)
    model = est.fit(df)
    out = model.transform(spark.read.parquet(url)).select("id", "prediction").collect()
    return model, {r["id"]: r["prediction"] for r in out}


def _check_decoded_and_predicted(spark, url, tmp_path, expected, reader="arrow"):
    df = spark.read.parquet(url)
    assert petastorm_codecs(df) == {"mat": Codec("ndarray", "float32", (4, 4)), "img": Codec("png", "uint8", (8, 8, 3)),
                                    **({"thumb": Codec("jpeg", "uint8", (6, 6))} if "thumb" in expected else {})}
    ds = prepare(df, Store(str(tmp_path / "prepared")), columns=["id", "mat", "img"])
    assert ds.shapes["mat"] == [4, 4] and ds.shapes["img"] == [8, 8, 3]
    seen = 0
    for batch in ds.batches(5, shuffle=False, drop_last=False, reader=reader):
        assert batch["mat"].dtype == torch.float32 and batch["img"].dtype == torch.uint8
        for i, row in enumerate(batch["id"].tolist()):
            np.testing.assert_array_equal(batch["mat"][i].numpy(), expected["mat"][row])
            np.testing.assert_array_equal(batch["img"][i].numpy(), expected["img"][row])
            seen += 1
    assert seen == len(expected["id"])

    model, predicted = _fit_and_transform(spark, url, tmp_path, reader)
    assert [h["epoch"] for h in model.history] == [0, 1] and np.isfinite(model.history[-1]["loss"])
    net = model.getModel().eval()
    with torch.no_grad():
        want = net(torch.from_numpy(expected["mat"]), torch.from_numpy(expected["img"])).squeeze(1).numpy()
    assert sorted(predicted) == sorted(expected["id"].tolist())
    np.testing.assert_allclose([predicted[i] for i in expected["id"].tolist()], want, rtol=1e-5, atol=1e-5)
    return model


def test_a_dataset_petastorm_wrote_trains_and_transforms_here_without_petastorm(spark, tmp_path):
    expected = _expected()
    url = "file://" + str(tmp_path / "dataset")
    shutil.copytree(FIXTURE, url[len("file://"):])
    _check_decoded_and_predicted(spark, url, tmp_path, expected)
    # JPEG: Pillow's libjpeg and petastorm's OpenCV may round a level apart
    ds = prepare(spark.read.parquet(url), Store(str(tmp_path / "thumbs")), columns=["id", "thumb"])
    rows = {i: t for b in ds.batches(8, shuffle=False, drop_last=False) for i, t in zip(b["id"].tolist(), b["thumb"])}
    for i, thumb in rows.items():
        assert thumb.shape == (6, 6)
        np.testing.assert_allclose(thumb.numpy().astype(int), expected["thumb"][i].astype(int), atol=2)


@pytest.mark.skipif(not CAN_WRITE, reason="writing petastorm datasets needs petastorm and opencv (make test-compat)")
@pytest.mark.parametrize("reader", ["arrow", "petastorm"])
def test_a_dataset_written_by_petastorm_here_trains_through_either_reader(spark, tmp_path, reader):
    from petastorm.codecs import CompressedImageCodec, NdarrayCodec, ScalarCodec
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import Unischema, UnischemaField, dict_to_spark_row
    from pyspark.sql.types import FloatType, IntegerType

    schema = Unischema("Schema", [
        UnischemaField("id", np.int32, (), ScalarCodec(IntegerType()), False),
        UnischemaField("label", np.float32, (), ScalarCodec(FloatType()), False),
        UnischemaField("mat", np.float32, (4, 4), NdarrayCodec(), False),
        UnischemaField("img", np.uint8, (8, 8, 3), CompressedImageCodec("png"), False),
    ])
    rng = np.random.default_rng(11)
    expected = {"id": np.arange(30), "mat": rng.standard_normal((30, 4, 4)).astype(np.float32),
                "img": rng.integers(0, 256, (30, 8, 8, 3), dtype=np.uint8)}
    url = "file://" + str(tmp_path / "written")
    with materialize_dataset(spark, url, schema, 1):
        rows = [dict_to_spark_row(schema, {"id": i, "label": float(expected["mat"][i].sum()),
                                           "mat": expected["mat"][i], "img": expected["img"][i]}) for i in range(30)]
        spark.createDataFrame(rows, schema.as_spark_schema()).coalesce(3).write.parquet(url)
    _check_decoded_and_predicted(spark, url, tmp_path, expected, reader=reader)
