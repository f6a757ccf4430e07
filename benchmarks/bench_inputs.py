"""Benchmarks of model inputs: reading int64 ids and uint8 images into torch, transformFn in
reader workers vs inline, sparse vs dense embedding gradients."""
from __future__ import annotations

import io
import os
import time

from common import Row, alternate


def _raw_reader(files, columns, widths, batch=1024, passes=1):
    """Plain pyarrow into torch tensors, the same files, no shuffle: the baseline."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    def read():
        count = 0
        for path in files * passes:
            f = pq.ParquetFile(path, memory_map=True)
            for i in range(f.num_row_groups):
                t = f.read_row_group(i, columns=columns)
                tensors = []
                for name in columns:
                    col = t.column(name).chunk(0)
                    if name in widths:
                        dtype, width = widths[name]
                        _, off, data = col.buffers()
                        start = np.frombuffer(off, dtype=np.int64)[col.offset]
                        arr = np.frombuffer(data, dtype=dtype, count=len(col) * width, offset=int(start))
                        tensors.append(torch.from_numpy(arr.reshape(len(col), width)))
                    else:
                        tensors.append(torch.from_numpy(col.to_numpy()))
                n = len(tensors[0])
                for s in range(0, n, batch):
                    count += len([x[s:s + batch] for x in tensors][0])
        return count

    return read


def _reader(ds, shuffle, batch=1024, passes=1, **kw):
    def read():
        return sum(len(b[ds.columns[0]]) for epoch in range(passes)
                   for b in ds.batches(batch, rank=0, size=1, shuffle=shuffle, epoch=epoch, drop_last=False, **kw))
    return read


def bench_inputs(spark, rows, reps, tmp, n=200_000):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    from sparkring import Store
    from sparkring.data import prepare

    store = Store(os.path.join(tmp, "inputs-store"))

    # int64 id columns (a recommender's)
    ids = (spark.range(n, numPartitions=4)
           .select((F.col("id") * 7919 % 2_000_000).alias("user"), (F.col("id") * 104_729 % 500_000).alias("item"),
                   (F.rand(1) > 0.5).cast("double").alias("label")))
    ds = prepare(ids, store, columns=["user", "item", "label"], reuse=False)
    files = [os.path.join(ds.data_dir, f["path"]) for f in ds.metadata["splits"]["train"]]
    passes = 10  # one pass takes a few ms: time ten
    ours, raw = alternate(_reader(ds, False, cache=False, passes=passes),
                          _raw_reader(files, ["user", "item", "label"], {}, passes=passes), reps + 2)
    rows.append(Row("inputs", f"reader rows/s into torch, {n // 1000}k rows of 2 int64 ids + label (no shuffle)",
                    f"{passes * n / ours / 1e6:.2f} M rows/s", f"raw pyarrow {passes * n / raw / 1e6:.2f} M rows/s",
                    raw / ours, ">= 0.8x", goal_value=0.8))

    # 3x32x32 uint8 images as tinyint arrays
    image_rows = n
    src = os.path.join(tmp, "images.parquet")
    rng = np.random.default_rng(0)
    chunk = 20_000
    with pq.ParquetWriter(src, pa.schema([("image", pa.list_(pa.int8())), ("label", pa.float64())])) as w:
        for start in range(0, image_rows, chunk):
            m = min(chunk, image_rows - start)
            flat = pa.array(rng.integers(-128, 128, size=m * 3072, dtype=np.int8))
            offsets = pa.array(np.arange(0, (m + 1) * 3072, 3072, dtype=np.int32))
            w.write_table(pa.table({"image": pa.ListArray.from_arrays(offsets, flat),
                                    "label": pa.array(rng.integers(0, 10, size=m).astype(np.float64))}))
    images = spark.read.parquet(src)
    t0 = time.perf_counter()
    ds = prepare(images, store, columns=["image", "label"], reuse=False)
    prepare_s = time.perf_counter() - t0
    assert ds.spec.column("image").dtype == "int8"
    files = [os.path.join(ds.data_dir, f["path"]) for f in ds.metadata["splits"]["train"]]
    raw_images = _raw_reader(files, ["image", "label"], {"image": (np.int8, 3072)})
    ours, raw = alternate(_reader(ds, False, cache=False), raw_images, reps + 2)
    rows.append(Row("inputs", f"reader rows/s into torch, {image_rows // 1000}k rows of 3x32x32 uint8 images "
                              f"(tinyint arrays, stored 1 byte/value; prepare {prepare_s:.0f} s) (no shuffle)",
                    f"{image_rows / ours / 1e6:.2f} M rows/s", f"raw pyarrow {image_rows / raw / 1e6:.2f} M rows/s",
                    raw / ours, ">= 0.8x", goal_value=0.8))
    ours_s, raw = alternate(_reader(ds, True, cache=False), raw_images, reps + 2)
    rows.append(Row("inputs", f"reader rows/s into torch, {image_rows // 1000}k images, shuffle=True, first epoch "
                              "(decode + gather) vs raw pyarrow unshuffled",
                    f"{image_rows / ours_s / 1e6:.2f} M rows/s", f"raw pyarrow {image_rows / raw / 1e6:.2f} M rows/s",
                    raw / ours_s, "(reference)"))
    _reader(ds, True)()  # the first epoch decodes the split into memory (up to 1 GiB per process)
    ours_s, raw = alternate(_reader(ds, True), raw_images, reps + 2)
    rows.append(Row("inputs", f"reader rows/s into torch, {image_rows // 1000}k images (586 MiB), shuffle=True "
                              "(what training uses), later epochs (the split held in memory, one gather per batch) "
                              "vs raw pyarrow unshuffled",
                    f"{image_rows / ours_s / 1e6:.2f} M rows/s", f"raw pyarrow {image_rows / raw / 1e6:.2f} M rows/s",
                    raw / ours_s, ">= 0.7x", goal_value=0.7))
    ds.delete()
    bench_decode_pool(spark, rows, reps, tmp, store)


def decode_png(batch):
    import numpy as np
    from PIL import Image

    images = [np.asarray(Image.open(io.BytesIO(b)), dtype=np.float32) / 255.0 for b in batch["png"]]
    return {"png": np.stack(images)}


def bench_decode_pool(spark, rows, reps, tmp, store, n=12_000, batch=64):
    """PNG decode in transformFn: in one reader worker (overlapping the step) vs inline."""
    import numpy as np
    import torch
    from PIL import Image

    from sparkring.data import prepare

    rng = np.random.default_rng(0)
    data = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)).save(buf, format="PNG")
        data.append((buf.getvalue(), float(i % 10)))
    df = spark.createDataFrame(data, "png binary, label double")
    ds = prepare(df, store, columns=["png", "label"], reuse=False)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(32 * 16 * 16, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    torch.set_num_threads(1)

    waits = {0: [], 1: []}

    def epoch(workers):
        def go():
            waited, count = 0.0, 0
            batches = iter(ds.batches(batch, rank=0, size=1, shuffle=True, transform=decode_png, workers=workers))
            while True:
                t0 = time.perf_counter()
                b = next(batches, None)
                waited += time.perf_counter() - t0  # the training thread waiting for its next batch
                if b is None:
                    break
                count += 1
                x = b["png"].permute(0, 3, 1, 2)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(x), b["label"].long()).backward()
                opt.step()
            waits[workers].append(waited / count)
        return go

    pooled, inline = alternate(epoch(1), epoch(0), reps)
    wait_pooled, wait_inline = (sorted(waits[w])[len(waits[w]) // 2] for w in (1, 0))
    rows.append(Row("inputs", f"PNG decode (32x32 RGB) in transformFn + conv step, {n // 1000}k rows, batches of "
                              f"{batch}, whole epoch: 1 reader worker vs inline on the training thread; the step "
                              f"waits {wait_pooled * 1e3:.2f} ms per batch for its next batch with the worker, "
                              f"{wait_inline * 1e3:.2f} ms (the decode) inline",
                    f"{n / pooled:,.0f} samples/s", f"inline {n / inline:,.0f} samples/s", inline / pooled,
                    "(speedup; goal: no wait when decode < step)"))
    ds.delete()


def bench_sparse(spark, rows, reps):
    import bench_fns

    from sparkring import run

    r = run(bench_fns.sparse_vs_dense_embedding, num_proc=2, verbose=0)[0]
    assert r["same"], "sparse and dense exchange trained different weights"
    rows.append(Row("inputs", "DistributedOptimizer step, EmbeddingBag 1M x 64, 4,096 ids/step, 2 ranks: sparse "
                              "exchange (allgather of ids + rows) vs sparse_as_dense (1M x 64 allreduce)",
                    f"{r['sparse_s'] * 1e3:.1f} ms/step", f"dense {r['dense_s'] * 1e3:.1f} ms/step",
                    r["dense_s"] / r["sparse_s"], "> 1x", goal_value=1.0))


def bench_recommender_fit(spark, rows, reps, tmp, n=200_000):
    """fit() on the recommender vs a hand-written TorchDistributor + DDP + pyarrow loop."""
    import bench_fns
    import numpy as np
    import torch
    from pyspark.ml.torch.distributor import TorchDistributor

    from sparkring import SparkRingEstimator, Store

    rng = np.random.default_rng(0)
    data = [(int(a), int(b), float(c), float(d)) for a, b, c, d in
            zip(rng.integers(0, 2000, n), rng.integers(0, 500, n), rng.normal(size=n), rng.integers(0, 2, n))]
    src = os.path.join(tmp, "ratings")
    spark.createDataFrame(data, "user int, item int, activity double, clicked double") \
        .repartition(4).write.mode("overwrite").parquet(src)
    df = spark.read.parquet(src)
    epochs, bs, lr = 2, 256, 0.1

    def ours():
        SparkRingEstimator(model=bench_fns.MatrixFactorization(sparse=False),
                           optimizer=lambda p: torch.optim.Adagrad(p, lr=lr),
                           loss="bce_with_logits", modelInputs=["user", "item", "activity"], labelCol="clicked",
                           batchSize=bs, epochs=epochs, numProc=2, verbose=0,
                           store=Store(os.path.join(tmp, "rec_store"))).fit(df)

    def baseline():
        path = os.path.join(tmp, "rec_td_parquet")
        df.write.mode("overwrite").parquet(path)
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".parquet"))
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
            bench_fns.ddp_recommender_training, [files[r::2] for r in range(2)], epochs, bs, lr)

    t_ours, t_td = alternate(ours, baseline, reps)
    sps = lambda t: n * epochs / t  # noqa: E731
    rows.append(Row("inputs", f"fit() of the recommender (2 int64 ids -> 2,000 x 8 and 500 x 8 embeddings + 1 dense "
                              f"column, the same model on both sides), {n // 1000}k rows, 2 ranks, {epochs} epochs, "
                              "whole fit",
                    f"{sps(t_ours):,.0f} samples/s", f"TorchDistributor+DDP+pyarrow {sps(t_td):,.0f} samples/s",
                    t_td / t_ours, ">= 1.0x", goal_value=1.0))
