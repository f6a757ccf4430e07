"""Elastic fit: global batches that do not depend on how many ranks train, checkpoints inside
an epoch, a fit that goes on after a lost rank (the same size in local mode; fewer ranks on a
standalone cluster whose worker is killed or decommissioned, and more again when it comes back)
and ends with the weights of an uninterrupted run."""
import contextlib
import re
import threading

import elastic_fns as E
import est_helpers as H
import pytest
import torch

from sparkring import SparkRingEstimator, Store
from sparkring.errors import RankTimeoutError


def _fit(df, store, **kw):
    params = dict(model=E.Paced(), optimizer=H.adam, loss="cross_entropy", batchSize=8, epochs=3, store=store,
                  verbose=0, seed=5, checkpointEvery=4, startTimeout=10.0,
                  # kept: the next fit of the same DataFrame reads the same Parquet (on a cluster two
                  # materializations may order rows differently)
                  keepData=True)
    params.update(kw)
    return SparkRingEstimator(**params).fit(df)


def _same_weights(a, b, atol=1e-5):
    x, y = a.getModel().state_dict(), b.getModel().state_dict()
    for key in x:
        torch.testing.assert_close(y[key], x[key], atol=atol, rtol=0)


def test_a_rank_lost_inside_an_epoch_resumes_at_the_next_checkpointed_step_with_the_same_weights(spark_wide,
                                                                                                  tmp_path, s3):
    df = H.classification_df(spark_wide, n=384)
    store = s3.store("elastic")  # data and checkpoints in an S3 bucket (moto's server on loopback)
    inputs = ["features", "id"]  # the model writes down the row ids it trains on
    plain = _fit(df, store, numProc=3, runId="uninterrupted", modelInputs=inputs)
    # 384 rows / (8 x 3) = 16 steps an epoch; rank 1 dies at its 22nd step (epoch 1, step 5), after the
    # checkpoint at step 4: the fit launches again and goes on at step 4
    audit = tmp_path / "audit"
    audit.mkdir()
    with _mlflow_store(tmp_path) as client:
        lost = _fit(df, store, numProc=3, runId="lost", modelInputs=inputs, mlflowLogging="on",
                    model=E.DiesOnce(str(tmp_path / "died"), rank=1, at=22, audit=str(audit)))
        [logged] = client.search_runs([client.get_experiment_by_name("elastic").experiment_id])
        assert [m.value for m in client.get_metric_history(logged.info.run_id, "restarts")] == [0, 1, 1]
        assert [m.value for m in client.get_metric_history(logged.info.run_id, "num_proc")] == [3, 3, 3]
    assert (tmp_path / "died").exists()
    assert [h["epoch"] for h in lost.history] == [0, 1, 2]
    assert [h["num_proc"] for h in lost.history] == [3, 3, 3]
    assert [h["restarts"] for h in lost.history] == [0, 1, 1]
    assert [h.get("resumed_at_step") for h in lost.history] == [None, 4, None]  # 1 step redone, of 4 at most
    _same_weights(plain, lost)
    assert [h["loss"] for h in lost.history] == pytest.approx([h["loss"] for h in plain.history], abs=1e-5)
    # across both launches, every row trained exactly once an epoch: the first launch's steps up to
    # the checkpoint (16 + 4 a rank), then the second launch's (12 + 16 a rank)
    first, second = _launches(audit, [3, 3])
    epochs = [[ids for steps in first for ids in steps[:16]],
              [ids for steps in first for ids in steps[16:20]] + [ids for steps in second for ids in steps[:12]],
              [ids for steps in second for ids in steps[12:]]]
    for seen in epochs:
        rows = [i for ids in seen for i in ids]
        assert sorted(rows) == list(range(384))


@contextlib.contextmanager
def _mlflow_store(tmp_path):
    """A SQLite MLflow tracking store of the test's own, its experiment active; restored after."""
    import mlflow
    from mlflow.tracking import MlflowClient

    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    try:
        mlflow.set_experiment(experiment_id=mlflow.create_experiment(
            "elastic", artifact_location=(tmp_path / "mlartifacts").as_uri()))
        yield MlflowClient()
    finally:
        while mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(before)


def _launches(audit, sizes):
    """The audit files' steps (row ids), a list a rank process, grouped by launch (the order the
    processes began in; ``sizes``: each launch's number of ranks)."""
    files = []
    for path in audit.iterdir():
        lines = [ln.split() for ln in path.read_text().splitlines()]
        files.append((float(lines[0][0]), [[int(i) for i in ln[1:]] for ln in lines]))
    assert len(files) == sum(sizes), (len(files), sizes)
    files.sort()
    starts = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    return [[steps for _, steps in files[a:b]] for a, b in zip(starts, starts[1:])]


class _AtCheckpoint:
    """Once the run's first checkpoint inside epoch 1 is written, does ``then`` to worker
    ``worker`` of the cluster (kill it, decommission it); with ``back``, starts it again once the
    ranks that went on without it finished epoch 1 (its checkpoint)."""

    def __init__(self, cluster, then, worker, store_dir, run_id, back=False):
        self.cluster, self.then, self.worker, self.back = cluster, then, worker, back
        # a complete checkpoint: the file, or the sharded one's trainer state (written once every shard is)
        self.at, self.back_at = [[f"{run_id}/**/{name}.pt", f"{run_id}/**/{name}.dcp/trainer.pt"]
                                 for name in ("epoch-00001-step-0000004", "epoch-00001")]
        self.store_dir, self.done = store_dir, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _wait(self, patterns):
        while not self.done.is_set() and not any(any(self.store_dir.rglob(p)) for p in patterns):
            self.done.wait(0.05)
        return not self.done.is_set()

    def _watch(self):
        if self._wait(self.at):
            self.then(self.worker)
            if self.back and self._wait(self.back_at):
                self.cluster.start_worker(self.worker, wait=False)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def test_an_elastic_fit_shrinks_grows_back_and_leaves_a_decommissioned_worker_ending_with_the_same_weights(
        spark_elastic, tmp_path, capsys):
    from conftest import _sessions

    cluster = _sessions.cluster
    df = H.classification_df(spark_elastic, n=384)
    store = Store(str(tmp_path / "store"))
    inputs = ["features", "id"]  # the model can write down the row ids it trains on
    plain = _fit(df, store, numProc=3, minProc=2, runId="uninterrupted", model=E.Paced(seconds=0.05),
                 modelInputs=inputs)
    # a sharded fit: worker 2 lost for good inside epoch 1 (3 -> 2 ranks finish it; steps slow while 2
    # train, so that the worker is back in time), started again after that epoch (2 -> 3 in epoch 2)
    paced = E.Paced(seconds=0.05, below=3, seconds_below=1.0)
    with _AtCheckpoint(cluster, cluster.kill_worker, 2, tmp_path / "store", "lost", back=True):
        lost = _fit(df, store, numProc=3, minProc=2, runId="lost", model=paced, strategy="fsdp", modelInputs=inputs,
                    verbose=1)
    said = capsys.readouterr().out
    # the console names the lost rank's executor and the step the ranks go on at
    resumed = lost.history[1]["resumed_at_step"]
    assert re.search(rf"^lost rank [012] \(executor [\w.-]+:\d+\)(: .*)?: going on with 2 of 3 ranks from step "
                     rf"{resumed + 1} of epoch 2 \(restart 1 of at most 3\)$", said, re.M), said
    assert re.search(r"^the slots are back: going on with 3 of 3 ranks from (step \d+ of epoch|the start of epoch) \d$",
                     said, re.M), said
    assert cluster.alive_workers() == 3
    assert lost.history[-1]["restarts"] == 1 and lost.history[-1]["grows"] == 1
    assert lost.history[1]["resumed_at_step"] in (4, 8, 12)  # at most checkpointEvery=4 steps redone
    assert [h["num_proc"] for h in lost.history] == [3, 2, 3]
    _same_weights(plain, lost)  # at 3, 2 then 3 ranks, sharded: the replicated uninterrupted 3-rank weights
    # worker 1 decommissioned (SIGPWR) inside epoch 1: the ranks checkpoint at their next step, the fit goes
    # on with 2 at once, and no step is redone: across both launches every row trains once an epoch
    audit = tmp_path / "audit"
    audit.mkdir()
    with _AtCheckpoint(cluster, cluster.decommission_worker, 1, tmp_path / "store", "decommissioned"):
        left = _fit(df, store, numProc=3, minProc=2, runId="decommissioned", modelInputs=inputs,
                    model=E.Paced(seconds=0.25, audit=str(audit)))
    assert [h["num_proc"] for h in left.history] == [3, 2, 2]
    assert [h["decommissions"] for h in left.history] == [0, 1, 1] and left.history[-1]["restarts"] == 0
    at = left.history[1]["resumed_at_step"]
    first, second = _launches(audit, [3, 2])
    assert all(len(steps) == 16 + at for steps in first)  # every step the first launch took counts
    epochs = [[ids for steps in first for ids in steps[:16]],
              [ids for steps in first for ids in steps[16:]] + [ids for steps in second for ids in steps[:16 - at]],
              [ids for steps in second for ids in steps[16 - at:]]]
    for seen in epochs:
        assert sorted(i for ids in seen for i in ids) == list(range(384))
    _same_weights(plain, left)
    # worker 2 lost for good: the one slot left is fewer than minProc, said within startTimeout
    with _AtCheckpoint(cluster, cluster.kill_worker, 2, tmp_path / "store", "starved"), pytest.raises(
            RankTimeoutError, match=r"offers 1 rank\(s\) within startTimeout=5s, fewer than minProc=2"):
        _fit(df, store, numProc=2, minProc=2, runId="starved", model=E.Paced(seconds=0.05), modelInputs=inputs,
             startTimeout=5.0)
