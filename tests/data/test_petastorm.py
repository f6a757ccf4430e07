"""reader="petastorm": the same rows per rank and epoch as the default reader (compat
environment, where petastorm imports); elsewhere a clear error naming what works."""
import importlib.util
import os

import pytest
import torch
from pyspark.sql import functions as F

from sparkring import ConfigurationError
from sparkring.data import Store, prepare

pytestmark = pytest.mark.compat  # version-dependent throughout (make test-compat)

HAS_PETASTORM = importlib.util.find_spec("petastorm") is not None
needs_petastorm = pytest.mark.skipif(not HAS_PETASTORM, reason="petastorm imports only beside pyarrow < 16 "
                                                               "(make test-compat)")


@pytest.fixture
def prepared(spark, tmp_path):
    # skewed partitions (90% of the rows in one), a tensor, an integer, a binary column, a validation split
    sc = spark.sparkContext
    rdd = sc.parallelize(range(900), 1).union(sc.parallelize(range(900, 1000), 1)).map(lambda i: (i,))
    df = (spark.createDataFrame(rdd, "id long")
          .withColumn("grid", F.array(*[(F.col("id") * k).cast("float") for k in range(4)]))
          .withColumn("label", (F.col("id") % 3).cast("int"))
          .withColumn("blob", F.encode(F.col("id").cast("string"), "utf-8")))
    return prepare(df, Store(str(tmp_path / "store")), columns=["id", "grid", "label", "blob"], validation=0.2,
                   seed=5)


def _epoch(ds, reader, rank, epoch, split, shuffle):
    return list(ds.batches(32, rank=rank, size=2, seed=3, epoch=epoch, split=split, shuffle=shuffle,
                           drop_last=split == "train", reader=reader, cache=False))


@needs_petastorm
def test_petastorm_reader_gives_every_rank_the_rows_of_the_default_reader(prepared):
    for split, shuffle in (("train", True), ("train", False), ("val", False)):
        for epoch in (0, 1):
            counts = set()
            for rank in (0, 1):
                arrow = _epoch(prepared, "arrow", rank, epoch, split, shuffle)
                peta = _epoch(prepared, "petastorm", rank, epoch, split, shuffle)
                assert len(arrow) == len(peta) > 0, (split, epoch, rank)
                counts.add(len(peta))
                for a, p in zip(arrow, peta):
                    assert a.keys() == p.keys()
                    for name in ("id", "grid", "label"):
                        assert a[name].dtype == p[name].dtype and torch.equal(a[name], p[name]), (name, split)
                    assert list(a["blob"]) == list(p["blob"])
                    assert a["grid"].shape == (len(a["id"]), 4)
            if split == "train":
                assert len(counts) == 1  # ranks stay in step on skewed partitions


@pytest.mark.skipif(HAS_PETASTORM, reason="petastorm is installed here")
def test_petastorm_reader_without_petastorm_names_the_versions_that_work(prepared):
    with pytest.raises(ConfigurationError, match=r"reader='petastorm' but petastorm cannot be imported here .*"
                                                 r"pyarrow < 16 .*petastorm 0.12.1, pyarrow 14.0.2"):
        next(prepared.batches(32, reader="petastorm"))


def test_an_unknown_reader_is_refused(prepared):
    with pytest.raises(ConfigurationError, match=r"reader='tfrecord' is not a reader; use one of 'arrow', 'petastorm'"):
        next(prepared.batches(32, reader="tfrecord"))


def _fit(spark, tmp_path, reader, run_id):
    import est_helpers as H

    from sparkring import SparkRingEstimator

    est = SparkRingEstimator(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=2,
                             numProc=2, seed=3, store=Store(str(tmp_path / "store")), runId=run_id, verbose=0,
                             validation=0.2, reader=reader)
    return est.fit(H.classification_df(spark))


@needs_petastorm
def test_fit_through_petastorm_ends_with_the_weights_of_the_default_reader(spark, tmp_path):
    arrow = _fit(spark, tmp_path, "arrow", "arrow").getModel().state_dict()
    peta_model = _fit(spark, tmp_path, "petastorm", "petastorm")
    for name, value in peta_model.getModel().state_dict().items():
        torch.testing.assert_close(value, arrow[name], atol=1e-6, rtol=0)
    assert [h["epoch"] for h in peta_model.history] == [0, 1] and "val_loss" in peta_model.history[-1]


@pytest.mark.skipif(HAS_PETASTORM, reason="petastorm is installed here")
def test_fit_with_the_petastorm_reader_where_it_cannot_import_is_refused_before_any_job(spark, tmp_path):
    jobs = len(spark.sparkContext.statusTracker().getJobIdsForGroup(None))
    with pytest.raises(ConfigurationError, match=r"reader='petastorm' but petastorm cannot be imported here"):
        _fit(spark, tmp_path, "petastorm", "refused")
    assert len(spark.sparkContext.statusTracker().getJobIdsForGroup(None)) == jobs


@needs_petastorm
def test_a_parquet_scan_fit_through_petastorm_reads_a_prepared_copy(spark, tmp_path):
    import est_helpers as H

    from sparkring import SparkRingEstimator

    path = str(tmp_path / "scan")
    H.classification_df(spark, n=96).write.parquet(path)
    store = Store(str(tmp_path / "store"))
    model = SparkRingEstimator(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=1,
                               numProc=2, store=store, runId="scan", verbose=0, keepData=True,
                               reader="petastorm").fit(spark.read.parquet(path))
    assert "train" in os.listdir(store.data_path("scan"))  # petastorm reads what prepare wrote, not Spark's files
    assert len(model.history) == 1
