"""A host's ranks hold a split's decoded rows once: each row group decoded by one rank serves
every rank there, the batches stay the same, a decoder that dies is taken over, and nothing is
left in /dev/shm."""
import mmap
import os
import signal

import numpy as np
import pytest
from pyspark.sql import functions as F
from spawn import spawn_ranks

from sparkring.collective import host_memory
from sparkring.data import Store, prepare
from sparkring.data.split_memory import SharedBuffer, SplitLayout, SplitMemory

ROW_GROUPS = 8


def _segments():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(host_memory.NAME_PREFIX))


@pytest.fixture
def dataset(spark, tmp_path):
    df = spark.range(0, 1600, numPartitions=ROW_GROUPS).withColumn(
        "x", F.array(F.col("id").cast("float"), (F.col("id") * 2).cast("float")))
    ds = prepare(df, Store(str(tmp_path / "store")), columns=["id", "x"])
    assert sum(len(f["row_groups"]) for f in ds.metadata["splits"]["train"]) == ROW_GROUPS
    return ds


def test_ranks_of_one_host_decode_each_row_group_once_and_get_the_same_batches(dataset):
    before = _segments()
    alone = spawn_ranks("shared_rows_fns", "epochs_of_batches", 2, dataset=dataset, epochs=3, share=False)
    shared = spawn_ranks("shared_rows_fns", "epochs_of_batches", 2, dataset=dataset, epochs=3, share=True)
    assert [ids for ids, _, _ in shared] == [ids for ids, _, _ in alone]
    assert [segments for _, _, segments in shared] == [1, 1]
    assert sum(decoded for _, decoded, _ in shared) == ROW_GROUPS  # once on the host, by either rank
    assert sum(decoded for _, decoded, _ in alone) > ROW_GROUPS  # each rank decodes its new shares itself
    assert _segments() == before


def test_an_elastic_fits_ranks_hold_the_whole_split_once_per_host(dataset):
    alone = spawn_ranks("shared_rows_fns", "elastic_global_batches", 2, dataset=dataset, share=False)
    shared = spawn_ranks("shared_rows_fns", "elastic_global_batches", 2, dataset=dataset, share=True)
    assert [ids for ids, _ in shared] == [ids for ids, _ in alone]
    assert [decoded for _, decoded in alone] == [ROW_GROUPS, ROW_GROUPS]
    assert sum(decoded for _, decoded in shared) == ROW_GROUPS


def test_ranks_on_different_hosts_each_decode_their_own(dataset):
    hosts = {r: {"SPARKRING_HOST_ID": f"host-{r}"} for r in range(2)}
    got = spawn_ranks("shared_rows_fns", "epochs_of_batches", 2, rank_env=hosts, dataset=dataset, epochs=2, share=True)
    assert [segments for _, _, segments in got] == [0, 0]
    assert all(decoded >= ROW_GROUPS // 2 for _, decoded, _ in got)


def _slices(rows, per_slice):
    return lambda path, rg: ({"x": np.arange(at, min(rows, at + per_slice))} for at in range(0, rows, per_slice))


def test_a_row_group_whose_decoder_dies_is_finished_by_the_rank_waiting_for_it(tmp_path):
    layout = SplitLayout.of(6, 1, {"x": ("int64", ())})
    units, key = [("a.parquet", 0, 6)], ("a.parquet", 0)
    with open(tmp_path / "segment", "w+b") as f:
        f.truncate(layout.nbytes)
        ready_r, ready_w = os.pipe()
        child = os.fork()
        if child == 0:  # the decoder: claims the row group, writes its first slice, then hangs
            try:
                memory = SplitMemory(units, SharedBuffer(mmap.mmap(f.fileno(), layout.nbytes), f.fileno(), layout))
                pieces = memory.pieces(key, 0, 6, _slices(6, 2))
                next(pieces)
                os.write(ready_w, b"x")
                signal.pause()
            finally:
                os._exit(0)
        os.read(ready_r, 1)
        memory = SplitMemory(units, SharedBuffer(mmap.mmap(f.fileno(), layout.nbytes), f.fileno(), layout))
        pieces = memory.pieces(key, 0, 6, _slices(6, 2))
        first = next(pieces)  # what the decoder wrote, read from the segment
        assert first.arrays["x"].tolist() == [0, 1] and memory.filled(key) == 2
        os.kill(child, signal.SIGKILL)  # its claim falls free: this reader decodes the rest itself
        os.waitpid(child, 0)
        rest = [x for piece in pieces for x in piece.arrays["x"].tolist()]
        assert rest == [2, 3, 4, 5] and memory.holds(key)


def test_a_split_held_in_this_process_decodes_a_row_group_once_for_every_piece_of_it():
    decoded = []
    read = _slices(10, 4)

    def counting(path, rg):
        decoded.append(rg)
        return read(path, rg)
    memory = SplitMemory([("a.parquet", 0, 10)])
    parts = [[x for p in memory.pieces(("a.parquet", 0), lo, hi, counting) for x in p.arrays["x"].tolist()]
             for lo, hi in ((3, 7), (0, 10), (8, 9))]
    assert parts == [[3, 4, 5, 6], list(range(10)), [8]] and decoded == [0]
