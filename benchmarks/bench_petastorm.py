"""The petastorm reader against the default Arrow reader on the same prepared data (compat
environment: petastorm imports only beside pyarrow < 16)."""
from __future__ import annotations

import os

from common import Row, alternate


def bench_readers(spark, rows, reps, tmp, n=200_000, d=64):
    """Rows/s into torch batches for one rank reading a whole epoch, arrow vs petastorm."""
    import pyarrow
    import pyspark
    from pyspark.sql import functions as F

    from sparkring import Store
    from sparkring.data import prepare

    df = (spark.range(n, numPartitions=4)
          .select(F.array(*[F.rand(i).cast("float") for i in range(d)]).alias("features"),
                  (F.rand(99) * 10).cast("int").alias("label")))
    ds = prepare(df, Store(os.path.join(tmp, "readers_store")), columns=["features", "label"])

    def epoch(reader):
        count = 0
        for batch in ds.batches(256, rank=0, size=1, shuffle=False, cache=False, reader=reader):
            count += len(batch["label"])
        assert count == n - n % 256
        return count

    def petastorm_as_users_run_it():
        # the usual loop: make_batch_reader over the whole dataset (its defaults: a thread pool of
        # 10 workers), then each column into torch
        import numpy as np
        import torch
        from petastorm import make_batch_reader

        count = 0
        train_dir = os.path.dirname(ds.metadata["splits"]["train"][0]["path"])
        url = "file://" + ds.store.local_path(f"{ds.data_dir}/{train_dir}")
        with make_batch_reader(url, schema_fields=["features", "label"], num_epochs=1) as source:
            for part in source:
                raw = np.frombuffer(b"".join(part.features.tolist()), dtype=np.float32).reshape(-1, d)
                x, y = torch.from_numpy(raw.copy()), torch.from_numpy(part.label.astype(np.int64))
                count += len(y) + 0 * x.shape[0]
        assert count == n
        return count

    arrow_s, petastorm_s = alternate(lambda: epoch("arrow"), lambda: epoch("petastorm"), reps)
    _, plain_s = alternate(lambda: epoch("arrow"), petastorm_as_users_run_it, reps)
    rows.append(Row("data", f"reader='arrow' vs reader='petastorm' (petastorm's make_batch_reader) on the same "
                            f"prepared data, {n // 1000}k rows x {d} floats, one rank, one epoch into torch "
                            f"(pyspark {pyspark.__version__}, pyarrow {pyarrow.__version__})",
                    f"{n / arrow_s:,.0f} rows/s", f"petastorm {n / petastorm_s:,.0f} rows/s", petastorm_s / arrow_s,
                    ">= 3x", goal_value=3.0))
    rows.append(Row("data", "reader='arrow' vs petastorm as its users run it (make_batch_reader over the whole "
                            "dataset with its defaults, columns into torch), same data and versions",
                    f"{n / arrow_s:,.0f} rows/s", f"petastorm {n / plain_s:,.0f} rows/s", plain_s / arrow_s,
                    "(reference)"))
