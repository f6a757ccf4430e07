"""Data at scale, side by side: fit() with its Store in an S3 bucket (moto's S3 API server on
loopback) against the same fit on a local path, the reader's rows/s from the bucket against raw
pyarrow reading the same files from the same server, and the time to the first batch of a large
Spark-written row group read in place, sliced against whole."""
from __future__ import annotations

import os
import pickle
import sys

from common import Row, alternate

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "helpers"))


def bench_store(spark, rows, reps, tmp, n=200_000):
    import torch
    from common import vector_df
    from s3_server import S3Server

    from sparkring import SparkRingEstimator, Store

    server = S3Server().start()
    server.make_bucket("runs")
    try:
        src = os.path.join(tmp, "store_source")
        vector_df(spark, n).write.mode("overwrite").parquet(src)
        df = spark.read.parquet(src)

        def fit(store):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
            SparkRingEstimator(model=net, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss="cross_entropy",
                               batchSize=256, epochs=2, numProc=2, verbose=0, readInPlace=False,
                               store=store).fit(df)

        s3, local = alternate(lambda: fit(server.store("bench")), lambda: fit(Store(os.path.join(tmp, "local"))),
                              reps)
        rows.append(Row("store", f"whole fit() with its Store in an S3 bucket (moto's server on loopback: data "
                        f"prepared there, a checkpoint each epoch) vs on a local path, {n // 1000}k rows x 64, "
                        "2 ranks, 2 epochs", f"{s3:.1f} s", f"local path {local:.1f} s", local / s3, "(reference)"))
        _reader_rows(spark, rows, reps, server, df, n)
    finally:
        server.stop()
    _first_batch_rows(spark, rows, reps, tmp)


def _reader_rows(spark, rows, reps, server, df, n):
    """The reader's rows/s from the bucket (no shuffle, no memory) vs raw pyarrow over s3fs."""
    import numpy as np
    import pyarrow.parquet as pq

    from sparkring.data import prepare

    store = server.store("reader")
    ds = prepare(df, store, columns=["features", "label"], reuse=False)
    files = [f"{ds.data_dir}/{f['path']}" for f in ds.metadata["splits"]["train"]]

    def ours():
        fresh = pickle.loads(pickle.dumps(ds))
        assert sum(len(b["label"]) for b in fresh.batches(1024, shuffle=False, drop_last=False, cache=False)) == n

    def raw():
        count = 0
        for path in files:
            f = pq.ParquetFile(store.fs.open_input_file(path))
            for i in range(f.num_row_groups):
                t = f.read_row_group(i)
                col = t.column("features").combine_chunks()
                _, _, data = col.buffers()
                x = np.frombuffer(data, dtype=np.float32, count=len(col) * 64).reshape(len(col), 64)
                count += len(x)
        assert count == n

    t_ours, t_raw = alternate(ours, raw, reps + 1)
    rows.append(Row("store", "reader rows/s from an S3 bucket into torch (no shuffle) vs raw pyarrow reading the "
                    "same files from the same server", f"{n / t_ours / 1e6:.2f} M rows/s",
                    f"raw pyarrow {n / t_raw / 1e6:.2f} M rows/s", t_raw / t_ours, ">= 0.8x", goal_value=0.8))


def _first_batch_rows(spark, rows, reps, tmp, n=1_000_000):
    """Seconds to the first shuffled batch of 1M rows x 64 read in place from Spark's own
    Parquet files (its default 128 MB row groups), decoded in slices vs whole."""
    from common import vector_df

    from sparkring.data import Store, prepare, reader

    src = os.path.join(tmp, "first_batch_source")
    vector_df(spark, n).coalesce(1).write.mode("overwrite").parquet(src)
    ds = prepare(spark.read.parquet(src), Store(os.path.join(tmp, "first_batch_store")),
                 columns=["features", "label"], in_place=True)
    groups = [len(f["row_groups"]) for f in ds.metadata["splits"]["train"]]

    def first_batch():
        fresh = pickle.loads(pickle.dumps(ds))
        next(iter(fresh.batches(256, rank=0, size=2, shuffle=True)))

    def whole():
        before = reader.SLICE_BYTES
        reader.SLICE_BYTES = 1 << 40
        try:
            first_batch()
        finally:
            reader.SLICE_BYTES = before

    sliced, whole_group = alternate(first_batch, whole, reps + 2)
    rows.append(Row("store", f"time to the first shuffled batch, {n // 1000}k rows x 64 read in place "
                    f"({sum(groups)} row group(s) as Spark wrote them), rank 0 of 2: decoded in slices vs the whole "
                    "row group first (as before)", f"{sliced * 1000:.0f} ms",
                    f"whole row group {whole_group * 1000:.0f} ms",
                    whole_group / sliced, "(reference)"))
