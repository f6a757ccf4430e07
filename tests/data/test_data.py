"""Data layer on real Spark and real Parquet: Store, prepare(), balanced batches."""
import os
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from pyspark.ml.linalg import Vectors
from pyspark.sql import functions as F

from sparkring.data import ColumnValues, DataError, Store, StoreError, prepare


@pytest.fixture
def store(tmp_path):
    return Store(str(tmp_path / "store"))


@pytest.fixture
def skewed_df(spark):
    # one partition holds 90% of the rows
    sc = spark.sparkContext
    rdd = sc.parallelize(range(900), 1).union(sc.parallelize(range(900, 1000), 1)).map(lambda i: (i,))
    df = spark.createDataFrame(rdd, "id long").withColumn(
        "x", F.array(F.col("id").cast("float"), (F.col("id") * 2).cast("float")))
    assert df.rdd.glom().map(len).collect() == [900, 100]
    return df


def _ids(ds, bs, size, **kw):
    per_rank = [[b["id"].tolist() for b in ds.batches(bs, rank=r, size=size, **kw)] for r in range(size)]
    return per_rank


@pytest.mark.parametrize("size", [pytest.param(2, marks=pytest.mark.compat), 3])
def test_skewed_partitions_give_every_rank_the_same_number_of_full_batches(skewed_df, store, size):
    ds = prepare(skewed_df, store, columns=["id", "x"])
    bs = 32
    per_rank = _ids(ds, bs, size, shuffle=True, seed=1, epoch=0)
    expected = 1000 // (size * bs)
    assert [len(batches) for batches in per_rank] == [expected] * size
    assert all(len(b) == bs for batches in per_rank for b in batches)
    flat = [i for batches in per_rank for b in batches for i in b]
    assert len(flat) == len(set(flat))  # no row twice in an epoch
    assert 1000 - len(flat) < size * bs
    assert ds.num_batches(bs, size) == expected


@pytest.mark.compat
def test_rows_decode_to_the_values_that_were_written(skewed_df, store):
    ds = prepare(skewed_df, store, columns=["id", "x"])
    for batch in ds.batches(50, rank=0, size=1, shuffle=True, seed=3):
        assert batch["x"].dtype == torch.float32 and batch["x"].shape == (50, 2)
        torch.testing.assert_close(batch["x"][:, 0], batch["id"].float())
        torch.testing.assert_close(batch["x"][:, 1], batch["id"].float() * 2)


def test_without_drop_last_every_row_is_read_exactly_once_across_ranks(skewed_df, store):
    ds = prepare(skewed_df, store, columns=["id"])
    per_rank = _ids(ds, 64, 3, shuffle=False, drop_last=False)
    flat = sorted(i for batches in per_rank for b in batches for i in b)
    assert flat == list(range(1000))
    sizes = [sum(len(b) for b in batches) for batches in per_rank]
    assert max(sizes) - min(sizes) <= 1


def test_shuffle_is_reproducible_for_a_seed_and_epoch_and_changes_between_epochs(skewed_df, store):
    ds = prepare(skewed_df, store, columns=["id"])
    a = _ids(ds, 10, 2, seed=5, epoch=1)
    b = _ids(ds, 10, 2, seed=5, epoch=1)
    c = _ids(ds, 10, 2, seed=5, epoch=2)
    assert a == b
    assert a != c
    plain = _ids(ds, 10, 1, shuffle=False)[0]
    assert [i for b in plain for i in b] == sorted(i for b in plain for i in b)


def test_more_ranks_than_rows_and_a_single_row(spark, store):
    df = spark.createDataFrame([(1.0, 7)], ["f", "id"])
    ds = prepare(df, store, columns=["f", "id"])
    assert ds.num_rows() == 1
    per_rank = _ids(ds, 4, 3, drop_last=False, shuffle=False)
    assert [i for batches in per_rank for b in batches for i in b] == [7]
    assert _ids(ds, 4, 3) == [[], [], []]  # drop_last: no full batch anywhere, all ranks agree


@pytest.mark.compat
def test_dense_and_sparse_vectors_and_numeric_arrays_become_fixed_shape_float_tensors(spark, store):
    df = spark.createDataFrame([
        (0, Vectors.dense([1.0, 2.0, 3.0]), [1, 2], 1.5),
        (1, Vectors.sparse(3, [2], [9.0]), [3, 4], 2.5),
    ], ["id", "vec", "arr", "label"])
    ds = prepare(df, store, columns=["id", "vec", "arr", "label"])
    assert ds.shapes == {"id": [], "vec": [3], "arr": [2], "label": []}
    batch = next(iter(ds.batches(2, rank=0, size=1, shuffle=False)))
    order = batch["id"].argsort()
    assert batch["vec"][order].tolist() == [[1.0, 2.0, 3.0], [0.0, 0.0, 9.0]]
    assert batch["arr"][order].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert batch["label"].dtype == torch.float64 and batch["id"].dtype == torch.int64
    # plain pyarrow reads the files too
    path = os.path.join(ds.data_dir, ds.metadata["splits"]["train"][0]["path"])
    table = pq.read_table(path)
    raw = np.frombuffer(table.column("vec")[0].as_py(), dtype=np.float32)
    assert raw.shape == (3,)


@pytest.mark.parametrize("rows,schema,match", [
    ([("a", 1.0)], "s string, y double", r"column 's' has type string.*StringIndexer"),
    ([({"k": 1.0}, 1.0)], "m map<string,double>, y double", r"column 'm' has type map"),
    ([([1.0], 1.0), ([1.0, 2.0], 2.0)], "a array<double>, y double",
     r"column 'a' holds arrays of different lengths \(1 to 2\)"),
    ([(1.0, None), (2.0, None), (3.0, 1.0)], "f double, y double", r"column 'y' has 2 null value\(s\) out of 3 rows"),
    ([(([1.0, None]), 1.0)], "a array<double>, y double", r"column 'a' has 1 array\(s\) with null elements"),
])
def test_unusable_columns_are_rejected_naming_the_column(spark, store, rows, schema, match):
    df = spark.createDataFrame(rows, schema)
    with pytest.raises(DataError, match=match):
        prepare(df, store, columns=df.columns)


def test_prepare_records_the_smallest_value_and_non_integral_count_of_numeric_scalars(spark, store):
    # what a class-index label is checked against, seen in prepare's own pass over the DataFrame
    rows = [(0, 0.0, 2, "a"), (1, 1.5, -3, "b"), (2, -2.0, 7, "c"), (3, 3.0, 1, "d"), (4, 4.25, 0, "e")]
    df = spark.createDataFrame(rows, "id long, y double, k int, s string").repartition(2)
    ds = prepare(df.drop("s"), store, columns=["y", "k", "id"], validation=0.4, seed=1)
    assert ds.values("y") == ColumnValues(minimum=-2.0, non_integral=2)  # 1.5 and 4.25, over both splits
    assert ds.values("k") == ColumnValues(minimum=-3, non_integral=0)
    assert ds.values("nope") is None


def test_missing_columns_empty_frames_and_bad_validation_are_rejected(spark, store):
    df = spark.createDataFrame([(1.0, 2.0)], "f double, y double")
    with pytest.raises(DataError, match=r"\['nope'\] are not in the DataFrame"):
        prepare(df, store, columns=["f", "nope"])
    with pytest.raises(DataError, match="empty"):
        prepare(df.filter("f > 10"), store, columns=["f", "y"])
    with pytest.raises(DataError, match="validation=1.5"):
        prepare(df, store, columns=["f"], validation=1.5)
    with pytest.raises(DataError, match="must be boolean"):
        prepare(df, store, columns=["f"], validation="y")


def test_validation_fraction_and_boolean_column_split_rows(spark, store):
    df = spark.range(0, 400).withColumn("is_val", F.col("id") % 4 == 0)
    by_col = prepare(df, store, columns=["id"], validation="is_val")
    val_ids = sorted(i for b in by_col.batches(64, split="val", shuffle=False, drop_last=False)
                     for i in b["id"].tolist())
    assert val_ids == list(range(0, 400, 4))
    by_frac = prepare(df, store, columns=["id"], validation=0.25, seed=3)
    assert 60 < by_frac.num_rows("val") < 140
    assert by_frac.num_rows("train") + by_frac.num_rows("val") == 400


def test_preparing_the_same_plan_and_columns_again_reuses_the_files(skewed_df, store):
    first = prepare(skewed_df, store, columns=["id", "x"])
    again = prepare(skewed_df, store, columns=["id", "x"])
    other = prepare(skewed_df, store, columns=["id"])
    assert again.data_dir == first.data_dir
    assert other.data_dir != first.data_dir
    first.delete()
    fresh = prepare(skewed_df, store, columns=["id", "x"])
    assert fresh.data_dir != first.data_dir and fresh.exists()


def test_cache_keeps_decoded_row_groups_for_later_epochs(skewed_df, store):
    ds = prepare(skewed_df, store, columns=["id"])
    first = _ids(ds, 10, 1, epoch=0, cache=True)
    assert ds._memory  # populated
    for f in ds.metadata["splits"]["train"]:
        os.remove(os.path.join(ds.data_dir, f["path"]))
    assert sorted(i for b in _ids(ds, 10, 1, epoch=1, cache=True)[0] for i in b) == \
        sorted(i for b in first[0] for i in b)


def test_store_lays_out_runs_and_refuses_an_unwritable_path(tmp_path):
    store = Store("file://" + str(tmp_path / "s"))
    assert store.checkpoint_path("r1") == str(tmp_path / "s" / "runs" / "r1" / "checkpoints")
    assert store.data_path("r1", "train").endswith("runs/r1/data/train")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="not writable"):
        Store(str(blocker / "below")).check_writable()
    temp = Store()
    assert temp.is_temporary and os.path.isdir(temp.root)


def test_a_reader_never_sees_a_half_written_checkpoint(tmp_path):
    store = Store(str(tmp_path))
    path = store.checkpoint_path("r", "latest.pt")
    versions = [bytes([v]) * (4 * 1024 * 1024) for v in range(1, 6)]
    store.write_bytes(path, versions[0])
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            data = store.read_bytes(path)
            seen.append(data == versions[data[0] - 1] if data else False)

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(4):
        for v in versions:
            store.write_bytes(path, v)
    stop.set()
    t.join()
    assert seen and all(seen)
    assert [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".tmp")] == []


def test_store_works_on_fsspec_urls_pyarrow_cannot_open():
    store = Store("memory://sparkring-tests/store")
    store.check_writable()
    path = store.checkpoint_path("r1", "epoch-00000.pt")
    store.write_bytes(path, b"weights")
    assert store.read_bytes(path) == b"weights"
    assert store.listdir(store.checkpoint_path("r1")) == ["epoch-00000.pt"]
    clone = __import__("pickle").loads(__import__("pickle").dumps(store))
    assert clone.read_bytes(path) == b"weights"


@pytest.mark.compat
def test_reader_keeps_a_split_in_memory_only_within_its_budget(skewed_df, store, monkeypatch):
    import sparkring.data.reader as reader_module

    ds = prepare(skewed_df, store, columns=["id", "x"])
    first = _ids(ds, 10, 1, epoch=0)
    assert ds._memory  # default: held while within the budget
    for f in ds.metadata["splits"]["train"]:
        os.rename(os.path.join(ds.data_dir, f["path"]), os.path.join(ds.data_dir, f["path"]) + ".away")
    again = _ids(ds, 10, 1, epoch=0)  # served from memory: the files are gone
    assert again == first
    for f in ds.metadata["splits"]["train"]:
        os.rename(os.path.join(ds.data_dir, f["path"]) + ".away", os.path.join(ds.data_dir, f["path"]))
    monkeypatch.setattr(reader_module, "MEMORY_BYTES", 0)
    tight = prepare(skewed_df, store, columns=["id", "x"])
    tight.__setstate__(tight.__getstate__())  # a fresh copy, as a rank gets
    in_order = _ids(ds, 10, 1, shuffle=False)
    assert _ids(tight, 10, 1, shuffle=False) == in_order
    assert not tight._memory
    assert _ids(ds, 10, 1, shuffle=False, cache=False) == in_order


@pytest.mark.parametrize("window, cache", [pytest.param(None, None, marks=pytest.mark.compat), (64, None),
                                           (100, None), (None, False), (64, False), (100, False)])
def test_shuffled_windows_yield_every_row_once_with_its_own_values(skewed_df, store, window, cache):
    ds = prepare(skewed_df, store, columns=["id", "x"])
    batches = list(ds.batches(32, shuffle=True, seed=5, epoch=1, drop_last=False, shuffle_buffer=window,
                              cache=cache))
    ids = torch.cat([b["id"] for b in batches])
    assert sorted(ids.tolist()) == list(range(1000))
    assert ids.tolist() != sorted(ids.tolist())
    for b in batches:
        torch.testing.assert_close(b["x"][:, 1], b["id"].float() * 2)
    assert all(len(b["id"]) == 32 for b in batches[:-1])


@pytest.mark.parametrize("window", [None, 64])
def test_batches_are_the_same_whether_the_split_is_held_in_memory_or_not(skewed_df, store, window):
    ds = prepare(skewed_df, store, columns=["id", "x"])
    for epoch in (0, 1):
        held = _ids(ds, 32, 2, shuffle=True, seed=3, epoch=epoch, shuffle_buffer=window)
        streamed = _ids(ds, 32, 2, shuffle=True, seed=3, epoch=epoch, shuffle_buffer=window, cache=False)
        assert held == streamed
    assert ds._memory
