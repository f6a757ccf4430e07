"""The elastic-fit benchmarks: what a checkpoint inside an epoch costs against a step, how long
a lost rank keeps training stopped, and how many steps are redone."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time

from common import Row, cluster_script, vector_df


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

    what = f"{n // 1000}k rows x 64, 3-layer MLP (width 256, Adam), batch {bs} x {ranks} ranks"
    for every in (10, 100):
        checkpoint_ms, step_ms = _checkpoint_and_step_ms(fit, net, tmp, every, reps)
        steps = checkpoint_ms / step_ms
        # the share of training time left to steps when every ``every`` steps one checkpoint is written
        rows.append(Row("elastic", f"checkpointEvery={every}: a checkpoint inside the epoch (rank 0 writes model + "
                        f"Adam state) takes {checkpoint_ms:.1f} ms = {steps:.2f} steps of {step_ms:.1f} ms, from the "
                        f"timeline ({what}); ratio: training time left to steps",
                        f"{checkpoint_ms:.1f} ms a checkpoint",
                        f"{every} steps {every * step_ms:.0f} ms", every / (every + steps), "(reference)"))
    _lost_rank_rows(rows, tmp, fit, bench_fns, n, bs, ranks)
    _lost_executor_row(rows, tmp)
    _decommission_row(rows, tmp)
    _lost_for_good_row(rows, tmp)
    rates = {"elastic": [], "plain": []}
    for _ in range(reps):  # alternating: an elastic fit (global batches, a stop check every step) vs a plain one
        for name, kw in (("elastic", {}), ("plain", {"minProc": None})):
            history = fit(net(), **kw).history
            rates[name].append(statistics.median(h["samples_per_second"] for h in history[1:]))
    elastic, plain = statistics.median(rates["elastic"]), statistics.median(rates["plain"])
    rows.append(Row("elastic", f"an elastic fit (minProc set: global batches, the driver's stop request agreed "
                    f"after every step) vs a plain fit, per-epoch samples/s ({what})", f"{elastic:,.0f} samples/s",
                    f"{plain:,.0f} samples/s", elastic / plain, "(reference)"))


def _checkpoint_and_step_ms(fit, net, tmp, every, reps):
    """Median milliseconds of rank 0's checkpoint spans inside epochs and of its training steps,
    read from the fit's timeline (Chrome trace), over ``reps`` fits."""
    checkpoints, steps = [], []
    for rep in range(reps):
        trace = os.path.join(tmp, f"elastic_trace_{every}_{rep}.json")
        fit(net(), checkpointEvery=every, timeline=trace)
        events = [e for e in json.load(open(trace))["traceEvents"] if e.get("ph") == "X" and e.get("pid") == 0]
        checkpoints += [e["dur"] / 1000 for e in events if e["name"].startswith("checkpoint (inside the epoch")]
        steps += [e["dur"] / 1000 for e in events if e["name"].startswith("step ")]
    return statistics.median(checkpoints), statistics.median(steps)


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


def _lost_executor_row(rows, tmp, kill_after_steps=300):
    """An elastic run() on local-cluster[2,1,1024]: once rank 0 stamped ``kill_after_steps``
    steps, one executor JVM (with its rank) is killed; the worker starts another. Seconds from
    the kill to the driver saying the ranks are lost (Spark's detection, the stage's end) and to
    the first step of the next launch."""
    import psutil

    stamps = os.path.join(tmp, "elastic_executor_steps")
    open(stamps, "w").close()
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "lost_executor.py"), stamps],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    noticed = []

    def read_stderr():
        for line in proc.stderr:
            if line.startswith("sparkring: lost rank"):
                noticed.append(time.time())

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    while proc.poll() is None and sum(1 for _ in open(stamps)) < kill_after_steps:
        time.sleep(0.05)
    executors = [p for p in psutil.Process(proc.pid).children(recursive=True) if _is_executor(p)]
    killed = time.time()
    executors[-1].kill()
    proc.wait(timeout=600)
    reader.join(10)
    stamped = [(pid, float(t)) for pid, t in (ln.split() for ln in open(stamps))]
    first_launch = next(pid for pid, t in reversed(stamped) if t <= killed)
    after = [t for pid, t in stamped if t > killed and pid != first_launch]  # the next launch's rank 0
    if proc.returncode != 0 or not after or not noticed:
        raise RuntimeError(f"the lost-executor run failed (exit {proc.returncode})")
    detected, training = noticed[0] - killed, after[0] - killed
    rows.append(Row("elastic", "a lost executor (its JVM killed while run(min_proc=1) trains on "
                    "local-cluster[2,1,1024]; "
                    f"the worker starts another): seconds from the loss to the next launch's first step; the "
                    f"driver knew the ranks lost after {detected:.1f} s (Spark's detection, the stage's end), the "
                    f"rest is waiting for the replacement executor and launching", f"{training:.1f} s",
                    "goal 30 s beyond detection", (training - detected) / 30, "<= 1.00x", higher_is_better=False,
                    goal_value=1.0))


def _is_executor(process) -> bool:
    import psutil

    try:
        return "CoarseGrainedExecutorBackend" in " ".join(process.cmdline())
    except psutil.Error:  # gone meanwhile, or a zombie
        return False


def _decommission_row(rows, tmp):
    """``decommission.py``: an elastic fit on a standalone cluster of three one-core workers, one
    decommissioned (SIGPWR) at the first checkpoint inside epoch 1, beside the same fit
    uninterrupted: the steps the two launches took together, less the uninterrupted fit's."""
    out = cluster_script("decommission.py", os.path.join(tmp, "elastic_decommission"))
    plain, left = out["uninterrupted"], out["decommissioned"]
    if left["num_proc"] != [3, 2, 2] or left["decommissions"] != 1 or left["restarts"] != 0:
        raise RuntimeError(f"the decommissioned fit did not go on with 2 ranks once: {left}")
    (first, second), [whole] = left["steps"], plain["steps"]
    redone = first + second - whole
    rows.append(Row("elastic", "steps redone after a decommission (SIGPWR to one of three standalone workers at the "
                    "first checkpoint inside epoch 1, spark.decommission.enabled, checkpointEvery=10): the steps of "
                    f"the launch of 3 ranks ({first}) and of 2 ({second}) less the uninterrupted fit's ({whole}); "
                    "ratio: redone steps over checkpointEvery", f"{redone} steps", "goal 0 (a loss: at most 10)",
                    redone / 10, "0.00x", higher_is_better=False, goal_value=0.0))


def _lost_for_good_row(rows, tmp):
    """``lost_for_good.py``: a worker killed for good at the first checkpoint inside epoch 1 of an
    elastic fit on three standalone workers (minProc=2): seconds from the kill to the next launch's
    first step (the fit goes on at once with 2 ranks), and the fit's wall time against the same fit
    uninterrupted."""
    out = cluster_script("lost_for_good.py", os.path.join(tmp, "elastic_lost_for_good"))
    plain, lost = out["uninterrupted"], out["lost"]
    if lost["num_proc"][-1] != 2 or lost["restarts"] != 1:
        raise RuntimeError(f"the fit did not go on with 2 ranks after one restart: {lost}")
    rows.append(Row("elastic", "a worker lost for good (one of three standalone one-core workers killed with its "
                    "executor at the first checkpoint inside epoch 1, minProc=2): seconds from the kill to the next "
                    "launch's first step, Spark's detection of the loss included",
                    f"{lost['kill_to_first_step']:.1f} s",
                    "goal 10 s", lost["kill_to_first_step"] / 10, "<= 1.00x", higher_is_better=False, goal_value=1.0))
    rows.append(Row("elastic", "that fit's seconds from its first step to its last (3 epochs of 40 global batches, "
                    "100 ms "
                    "steps; the epochs after the loss on 2 ranks) against the same fit uninterrupted on three workers",
                    f"{lost['training']:.1f} s", f"uninterrupted {plain['training']:.1f} s",
                    lost["training"] / plain["training"], "(reference)", higher_is_better=False))


def bench_autoscaling(rows, tmp):
    """``autoscaling.py``: 4 ranks as 2 tasks x 2 beside 4 tasks x 1 (run() wall time), and a fit's
    seconds to its first step under dynamic allocation from no executor beside a fixed-size cluster."""
    out = cluster_script("autoscaling.py", os.path.join(tmp, "autoscaling"))
    two, four = out["launch"]["2x2"], out["launch"]["4x1"]
    rows.append(Row("autoscaling", "run() of 4 ranks as 2 tasks x 2 ranks vs 4 tasks x 1 rank (two standalone workers "
                    "of two cores), wall time", f"{two:.2f} s", f"4 x 1: {four:.2f} s", two / four, "<= 1.10x",
                    higher_is_better=False, goal_value=1.10))
    cold, fixed = out["autoscaled_first_step"], out["fixed_first_step"]
    rows.append(Row("autoscaling", "fit(numProc=2): seconds from fit() to the first step under dynamic allocation "
                    "started with no executor (their start included) vs a fixed-size cluster with its executors up",
                    f"{cold:.1f} s", f"fixed size: {fixed:.1f} s", cold / fixed, "(reference)", higher_is_better=False))
