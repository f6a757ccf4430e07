"""A DataFrame that only scans Parquet files is read where the files lie: no prepare job, the
same rows as prepare would write, validation rows drawn per row group, and prepare (with its
errors) for anything else."""
import logging
import os
import shutil

import est_helpers as H
import numpy as np
import pytest
from pyspark.ml.linalg import Vectors
from pyspark.sql import functions as F

from sparkring import RankFailedError, SparkRingEstimator
from sparkring.data import DataError, Store, prepare

COLUMNS = ["id", "features", "label", "pair"]


@pytest.fixture
def store(tmp_path):
    return Store(str(tmp_path / "store"))


def _write(spark, path, rows, names, partitions=3):
    df = spark.createDataFrame(rows, names)
    if "pair" in names:
        df = df.withColumn("pair", F.col("pair").cast("array<float>"))
    df.repartition(partitions).write.parquet(path)
    return spark.read.parquet(path)


@pytest.fixture
def scanned(spark, tmp_path):
    rows = [(i, Vectors.dense([i, i / 2, -i]), float(i % 3), [float(i), float(i + 1)], i % 5 == 0) for i in range(301)]
    return _write(spark, str(tmp_path / "scanned"), rows, COLUMNS + ["held"])


def _every_row(ds):
    """Every training row once, as numpy arrays per column, sorted by id."""
    batches = list(ds.batches(16, shuffle=False, drop_last=False))
    got = {c: np.concatenate([b[c].numpy() for b in batches]) for c in batches[0]}
    order = np.argsort(got["id"])
    return {c: v[order] for c, v in got.items()}


def _jobs_during(spark, fn):
    sc = spark.sparkContext
    sc.setJobGroup("in-place-check", "counting jobs")
    try:
        return fn(), len(sc.statusTracker().getJobIdsForGroup("in-place-check"))
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)


@pytest.mark.compat
def test_a_parquet_scan_is_read_in_place_without_a_job_giving_the_rows_prepare_writes(spark, store, scanned):
    in_place, jobs = _jobs_during(spark, lambda: prepare(scanned, store, columns=COLUMNS, in_place=True))
    prepared = prepare(scanned, store, columns=COLUMNS)
    assert in_place.in_place and not prepared.in_place
    assert jobs == 0
    assert in_place.num_rows() == prepared.num_rows() == 301 and in_place.num_rows("val") == 0
    assert in_place.shapes == prepared.shapes == {"id": [], "features": [3], "label": [], "pair": [2]}
    assert in_place.values("label").minimum == 0.0
    ours, theirs = _every_row(in_place), _every_row(prepared)
    for c in COLUMNS:
        assert ours[c].dtype == theirs[c].dtype
        np.testing.assert_array_equal(ours[c], theirs[c])
    assert [in_place.num_batches(16, size) for size in (2, 3)] == [prepared.num_batches(16, size) for size in (2, 3)]
    elastic = [b for r in range(2) for b in in_place.global_batches(30, rank=r, size=2, epoch=1)]  # an elastic fit's
    ids = np.concatenate([b["id"].numpy() for b in elastic])
    assert len(ids) == 300 and len(set(ids.tolist())) == 300 and set(ids.tolist()) <= set(range(301))
    np.testing.assert_array_equal(np.concatenate([b["pair"].numpy() for b in elastic])[:, 0], ids.astype(np.float32))
    in_place.delete()
    assert len(os.listdir(os.path.dirname(scanned.inputFiles()[0].replace("file://", "")))) > 1  # the files stay


def test_a_selection_of_the_scanned_columns_is_read_in_place(spark, store, scanned):
    ds = prepare(scanned.select("label", "features"), store, columns=["features", "label"], in_place=True)
    assert ds.in_place and ds.num_rows() == 301


@pytest.mark.parametrize("change", ["filtered", "computed", "limited", "validation_column", "sparse", "not_asked"])
def test_anything_but_a_plain_scan_of_dense_columns_is_prepared(spark, store, scanned, tmp_path, change):
    df, validation, in_place = scanned, None, True
    if change == "filtered":
        df = scanned.where("label > 0")
    elif change == "computed":
        df = scanned.withColumn("label", F.col("label") + 1)
    elif change == "limited":
        df = scanned.limit(50)
    elif change == "validation_column":
        validation = "held"
    elif change == "sparse":
        rows = [(i, Vectors.sparse(3, [i % 3], [1.0]), 1.0, [0.0, 1.0]) for i in range(20)]
        df = _write(spark, str(tmp_path / "sparse"), rows, COLUMNS)
    else:
        in_place = False
    ds = prepare(df, store, columns=COLUMNS, validation=validation, seed=0, in_place=in_place)
    assert not ds.in_place
    expected = {"filtered": 200, "limited": 50, "sparse": 20}.get(change, 301)
    assert ds.num_rows() + ds.num_rows("val") == expected
    if change == "validation_column":
        assert ds.num_rows("val") == 61
    if change == "sparse":
        np.testing.assert_array_equal(_every_row(ds)["features"].sum(axis=1), np.ones(20, dtype=np.float32))


def test_a_validation_fraction_holds_out_rows_drawn_per_row_group_by_the_seed(spark, store, scanned):
    def split_ids(seed):
        ds = prepare(scanned, store, columns=COLUMNS, validation=0.25, seed=seed, in_place=True)
        assert ds.in_place
        ids = {}
        for split in ("train", "val"):
            batches = list(ds.batches(16, shuffle=False, drop_last=False, split=split))
            ids[split] = np.concatenate([b["id"].numpy() for b in batches])
            np.testing.assert_array_equal(np.concatenate([b["pair"].numpy() for b in batches])[:, 0],
                                          ids[split].astype(np.float32))  # each row keeps its own values
            assert len(ids[split]) == ds.num_rows(split)
        return set(ids["train"].tolist()), set(ids["val"].tolist())

    train, val = split_ids(7)
    assert not train & val and train | val == set(range(301))
    assert 40 < len(val) < 115  # a quarter of 301, drawn
    assert split_ids(7) == (train, val) and split_ids(8)[1] != val


def _rows_of(ds, split):
    batches = list(ds.batches(16, shuffle=False, drop_last=False, split=split))
    got = {c: np.concatenate([b[c].numpy() for b in batches]) for c in batches[0]}
    order = np.argsort(got["id"])
    return {c: v[order] for c, v in got.items()}


@pytest.mark.compat
def test_a_scan_prepared_as_a_copy_is_copied_by_pyarrow_with_the_rows_and_split_of_reading_in_place(
        spark, store, scanned, caplog):
    with caplog.at_level(logging.INFO, logger="sparkring.data.prepare"):
        copied = prepare(scanned, store, columns=COLUMNS, validation=0.25, seed=7)
    assert "copying 3 Parquet file(s) into the Store with pyarrow" in caplog.text
    in_place = prepare(scanned, store, columns=COLUMNS, validation=0.25, seed=7, in_place=True)
    assert not copied.in_place and in_place.in_place
    assert copied.shapes == in_place.shapes == {"id": [], "features": [3], "label": [], "pair": [2]}
    assert copied.values("label").minimum == 0.0 and copied.values("label").non_integral == 0
    for split in ("train", "val"):
        assert copied.num_rows(split) == in_place.num_rows(split) > 0
        ours, theirs = _rows_of(copied, split), _rows_of(in_place, split)
        for c in COLUMNS:
            assert ours[c].dtype == theirs[c].dtype
            np.testing.assert_array_equal(ours[c], theirs[c])
    source = os.path.dirname(scanned.inputFiles()[0].replace("file://", ""))
    shutil.rmtree(source)  # the copy is the Store's own
    assert len(_rows_of(copied, "train")["id"]) == copied.num_rows()


def test_many_small_scanned_files_share_the_copy_tasks(spark, store, tmp_path, caplog):
    rows = [(i, Vectors.dense([i, -i]), float(i % 2)) for i in range(40)]
    df = _write(spark, str(tmp_path / "small"), rows, ["id", "features", "label"], partitions=10)
    assert len(df.inputFiles()) == 10
    with caplog.at_level(logging.INFO, logger="sparkring.data.prepare"):
        ds = prepare(df, store, columns=["id", "features", "label"])
    tasks = 2 * spark.sparkContext.defaultParallelism
    assert f"copying 10 Parquet file(s) into the Store with pyarrow ({tasks} tasks)" in caplog.text
    assert len(os.listdir(os.path.join(ds.data_dir, "train"))) == tasks  # one file a task
    got = _rows_of(ds, "train")
    np.testing.assert_array_equal(got["id"], np.arange(40))
    np.testing.assert_array_equal(got["features"][:, 1], -np.arange(40, dtype=np.float32))


def test_ragged_arrays_in_a_scan_prepared_as_a_copy_are_refused_before_any_rank_runs(spark, store, tmp_path):
    rows = [(0, [1.0]), (1, [1.0, 2.0, 3.0])]  # 4 values in 2 rows: the footer reads 2 per row
    df = _write(spark, str(tmp_path / "ragged"), rows, ["id", "pair"], partitions=1)
    with pytest.raises(DataError, match=r"column 'pair' holds arrays of different lengths \(1 to 3\)"):
        prepare(df, store, columns=["id", "pair"])


def test_a_null_in_a_scanned_column_gets_prepares_error(spark, store, tmp_path):
    rows = [(i, Vectors.dense([1.0, 2.0]), None if i == 3 else 1.0) for i in range(10)]
    df = _write(spark, str(tmp_path / "nulls"), rows, ["id", "features", "label"])
    with pytest.raises(DataError, match=r"column 'label' has 1 null value\(s\) out of 10 rows"):
        prepare(df, store, columns=["features", "label"], in_place=True)


@pytest.mark.compat
def test_ragged_arrays_the_footers_cannot_tell_are_refused_as_they_are_read(spark, store, tmp_path):
    rows = [(0, [1.0]), (1, [1.0, 2.0, 3.0])]  # 4 values in 2 rows: the footer reads 2 per row
    df = _write(spark, str(tmp_path / "ragged"), rows, ["id", "pair"], partitions=1)
    ds = prepare(df, store, columns=["id", "pair"], in_place=True)
    assert ds.in_place and ds.shapes["pair"] == [2]
    with pytest.raises(DataError, match=r"column 'pair' holds arrays of different lengths \(1 to 3\) in .*\.parquet"):
        list(ds.batches(2, shuffle=False))


def test_class_labels_read_in_place_are_checked_as_the_ranks_read_them(spark, store, tmp_path):
    rows = [(i, Vectors.dense([1.0, 2.0]), 0.5 if i == 7 else 1.0) for i in range(10)]
    df = _write(spark, str(tmp_path / "halves"), rows, ["id", "features", "label"], partitions=1)
    ds = prepare(df, store, columns=["features", "label"], in_place=True, integral=["label"])
    assert ds.in_place and ds.values("label").non_integral is None  # not counted: checked as read
    with pytest.raises(DataError, match=r"column 'label' has 1 non-integral value\(s\) in .*, but the loss needs"):
        list(ds.batches(2))
    assert len(list(prepare(df, store, columns=["features", "label"], in_place=True).batches(2))) == 5


def test_fit_on_a_parquet_scan_trains_on_the_files_in_place_and_predicts_as_well(spark, store, tmp_path):
    path = str(tmp_path / "digits-like")
    H.classification_df(spark, n=480).write.parquet(path)
    df = spark.read.parquet(path)

    def fit(run_id, **kw):
        return SparkRingEstimator(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=4,
                                  numProc=2, seed=3, store=store, verbose=0, keepData=True, runId=run_id,
                                  validation=0.2, **kw).fit(df)

    in_place, prepared = fit("in-place"), fit("prepared", readInPlace=False)
    assert os.listdir(store.data_path("in-place")) == ["_sparkring_metadata.json"]  # nothing copied
    assert "train" in os.listdir(store.data_path("prepared"))

    def accuracy(model):
        rows = model.transform(df).select("label", "prediction").collect()
        return np.mean([r.prediction == r.label for r in rows])

    assert accuracy(in_place) > 0.9 and abs(accuracy(in_place) - accuracy(prepared)) < 0.05
    assert in_place.history[-1]["loss"] < in_place.history[0]["loss"]
    assert in_place.history[-1]["val_loss"] < in_place.history[0]["val_loss"]


def test_fit_refuses_class_labels_read_in_place_that_are_not_class_indices(spark, store, tmp_path):
    def fit(labels, name):
        rows = [(i, Vectors.dense([float(i), 1.0]), labels(i)) for i in range(64)]
        df = _write(spark, str(tmp_path / name), rows, ["id", "features", "label"], partitions=2)
        return SparkRingEstimator(model=H.mlp(d=2), optimizer=H.adam, loss="cross_entropy", batchSize=8, epochs=1,
                                  numProc=2, store=store, verbose=0).fit(df)

    with pytest.raises(DataError, match=r"labelCol 'label' has negative value -1; class indices start at 0"):
        fit(lambda i: -1.0 if i == 5 else 1.0, "negative")  # the footers' smallest value, before any job
    refused = r"column 'label' has 1 non-integral value\(s\) in .*\.parquet, but the loss"
    with pytest.raises(RankFailedError, match=refused) as info:
        fit(lambda i: 0.5 if i == 9 else 1.0, "halves")  # the rank reading that file
    assert "DataError" in str(info.value)


@pytest.fixture(scope="module")
def one_big_row_group(tmp_path_factory):
    """250,000 rows of 128 float32s in one row group (~128 MB decoded): as Spark writes by default."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 250_000
    values = np.random.default_rng(0).random(rows * 128, dtype=np.float32)
    table = pa.table({"id": np.arange(rows), "features": pa.FixedSizeListArray.from_arrays(values, 128).cast(
        pa.list_(pa.float32())), "label": (np.arange(rows) % 3).astype(np.float64)})
    path = tmp_path_factory.mktemp("big") / "part-0.parquet"
    pq.write_table(table, path, row_group_size=rows, compression="gzip")  # decoding costs what it does on real data
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    return str(path)


def test_the_first_batch_of_a_large_row_group_comes_after_one_slice_not_the_whole_group(spark, store,
                                                                                      one_big_row_group, monkeypatch):
    import pickle
    import time

    from sparkring.data import reader

    ds = prepare(spark.read.parquet(one_big_row_group), store, columns=["id", "features", "label"], in_place=True)
    assert ds.in_place

    def first_batch():
        fresh = pickle.loads(pickle.dumps(ds))  # nothing decoded yet
        start = time.perf_counter()
        next(iter(fresh.batches(64, shuffle=True, seed=1)))
        return time.perf_counter() - start

    sliced = min(first_batch() for _ in range(3))
    monkeypatch.setattr(reader, "SLICE_BYTES", 1 << 40)  # as before slicing: the whole row group first
    whole = min(first_batch() for _ in range(3))
    assert sliced < 0.4 * whole, (sliced, whole)  # one slice of ~16k rows is a sixteenth of the group


def test_a_first_window_of_one_slice_moves_rows_nearly_as_far_as_a_full_shuffle(spark, store, one_big_row_group):
    ds = prepare(spark.read.parquet(one_big_row_group), store, columns=["id", "features", "label"], in_place=True)
    order = np.concatenate([b["id"].numpy() for b in ds.batches(64, shuffle=True, seed=1,
                                                                 drop_last=False)])
    assert np.array_equal(np.sort(order), np.arange(250_000))  # every row once
    moved = np.abs(order - np.arange(len(order))).mean()
    full = len(order) / 3  # how far a full shuffle moves a row, on average
    assert 0.7 * full < moved < 1.1 * full, moved / full
