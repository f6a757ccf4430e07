"""The elastic-fit benchmarks: what a checkpoint inside an epoch costs against a step, how long
a lost rank keeps training stopped, and how many steps are redone."""
from __future__ import annotations

import os
import statistics

from common import Row, vector_df


def bench_elastic(spark, rows, reps, tmp, n=100_000, epochs=3):
    import bench_fns
    import torch

    from sparkring import SparkRingEstimator, Store

    src = os.path.join(tmp, "elastic_source")
    vector_df(spark, n).write.mode("overwrite").parquet(src)
    df = spark.read.parquet(src).cache()
    store, bs, ranks = Store(os.path.join(tmp, "elastic_store")), 256, 2

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                   torch.nn.ReLU(), torch.nn.Linear(256, 10))

    def fit(model, **kw):
        params = dict(model=model, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss="cross_entropy",
                      batchSize=bs, epochs=epochs, numProc=ranks, minProc=ranks, verbose=0, store=store, keepData=True)
        return SparkRingEstimator(**{**params, **kw}).fit(df)

    def rate(**kw):
        return statistics.median(h["samples_per_second"] for h in fit(net(), **kw).history[1:])

    got = {every: [] for every in (None, 10, 100)}
    for _ in range(reps):
        for every in got:
            got[every].append(rate(checkpointEvery=every))
    plain = statistics.median(got[None])
    step_s = bs * ranks / plain
    what = f"{n // 1000}k rows x 64, 3-layer MLP (width 256, Adam), batch {bs} x {ranks} ranks, per-epoch samples/s"
    for every in (10, 100):
        with_ckpt = statistics.median(got[every])
        per_checkpoint = (1 / with_ckpt - 1 / plain) * bs * ranks * every  # the extra seconds of each
        rows.append(Row("elastic", f"checkpointEvery={every} vs end-of-epoch checkpoints only ({what}); one checkpoint "
                        f"costs {max(per_checkpoint, 0) / step_s:.1f} steps",
                        f"{with_ckpt:,.0f} samples/s", f"{plain:,.0f} samples/s", with_ckpt / plain, "(reference)"))
    _lost_rank_rows(rows, tmp, fit, bench_fns, n, bs, ranks)


def _lost_rank_rows(rows, tmp, fit, bench_fns, n, bs, ranks, every=10, at_step=25):
    """Rank 1's process exits at step ``at_step`` of epoch 1 (a lost rank in local mode: the
    runner, not Spark's heartbeat, notices): seconds until the relaunched ranks train again, and
    the steps redone from the last checkpoint inside the epoch."""
    died, back = os.path.join(tmp, "elastic_died"), os.path.join(tmp, "elastic_back")
    steps = n // (bs * ranks)  # an epoch's global batches (no validation split)
    lost = fit(bench_fns.DiesOnceAt(died, back, at=steps + at_step), checkpointEvery=every, epochs=2,
               runId="elastic-lost")
    seconds = float(open(back).read()) - float(open(died).read())
    rows.append(Row("elastic", "a lost rank (its process exits inside epoch 1, local mode, 2 ranks): seconds from its "
                    "death to the relaunched ranks' first step (failure noticed, slots checked, stage launched, "
                    "ranks started, checkpoint loaded)", f"{seconds:.1f} s", "goal 30 s", seconds / 30, "<= 1.00x",
                    higher_is_better=False, goal_value=1.0))
    redone = (at_step - 1) - lost.history[1]["resumed_at_step"]  # steps finished after the last checkpoint
    rows.append(Row("elastic", f"steps redone after that loss, checkpointEvery={every}", f"{redone} steps",
                    f"at most {every}", redone / every, "<= 1.00x", higher_is_better=False, goal_value=1.0))
