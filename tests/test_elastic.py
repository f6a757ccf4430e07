"""Elastic fit: global batches that do not depend on how many ranks train, checkpoints inside
an epoch, a fit that goes on after a lost rank (the same size in local mode; fewer ranks on a
standalone cluster whose worker is killed, and more again when it comes back) and ends with the
weights of an uninterrupted run."""
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
                                                                                                  tmp_path):
    df = H.classification_df(spark_wide, n=384)
    store = Store(str(tmp_path / "store"))
    inputs = ["features", "id"]  # the model writes down the row ids it trains on
    plain = _fit(df, store, numProc=3, runId="uninterrupted", modelInputs=inputs)
    # 384 rows / (8 x 3) = 16 steps an epoch; rank 1 dies at its 22nd step (epoch 1, step 5), after the
    # checkpoint at step 4: the fit launches again and goes on at step 4
    audit = tmp_path / "audit"
    audit.mkdir()
    lost = _fit(df, store, numProc=3, runId="lost", modelInputs=inputs,
                model=E.DiesOnce(str(tmp_path / "died"), rank=1, at=22, audit=str(audit)))
    assert (tmp_path / "died").exists()
    assert [h["epoch"] for h in lost.history] == [0, 1, 2]
    assert [h["num_proc"] for h in lost.history] == [3, 3, 3]
    assert [h["restarts"] for h in lost.history] == [0, 1, 1]
    assert [h.get("resumed_at_step") for h in lost.history] == [None, 4, None]  # 1 step redone, of 4 at most
    _same_weights(plain, lost)
    assert [h["loss"] for h in lost.history] == pytest.approx([h["loss"] for h in plain.history], abs=1e-5)
    # across both launches, every row trained exactly once an epoch: the first launch's steps up to
    # the checkpoint (16 + 4 a rank), then the second launch's (12 + 16 a rank)
    first, second = _launches(audit, ranks=3)
    epochs = [[ids for steps in first for ids in steps[:16]],
              [ids for steps in first for ids in steps[16:20]] + [ids for steps in second for ids in steps[:12]],
              [ids for steps in second for ids in steps[12:]]]
    for seen in epochs:
        rows = [i for ids in seen for i in ids]
        assert sorted(rows) == list(range(384))


def _launches(audit, ranks):
    """The audit files' steps (row ids), a list a rank process, grouped by launch (the order the
    processes began in)."""
    files = []
    for path in audit.iterdir():
        lines = [ln.split() for ln in path.read_text().splitlines()]
        files.append((float(lines[0][0]), [[int(i) for i in ln[1:]] for ln in lines]))
    files.sort()
    return [[steps for _, steps in files[k:k + ranks]] for k in range(0, len(files), ranks)]


class _LoseAndBringBack:
    """Kills a worker of the cluster once the run's first checkpoint inside epoch 1 is written;
    with ``back``, starts it again once the ranks that went on without it wrote a checkpoint."""

    def __init__(self, cluster, worker, store_dir, run_id, back=False):
        self.cluster, self.worker, self.back = cluster, worker, back
        self.lost_at, self.back_at = f"{run_id}/**/epoch-00001-step-0000004.*", f"{run_id}/**/epoch-00001-step-0000008.*"
        self.store_dir, self.done = store_dir, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _wait(self, pattern):
        while not self.done.is_set() and not any(self.store_dir.rglob(pattern)):
            self.done.wait(0.05)
        return not self.done.is_set()

    def _watch(self):
        if self._wait(self.lost_at):
            self.cluster.kill_worker(self.worker)
            if self.back and self._wait(self.back_at):
                self.cluster.start_worker(self.worker, wait=False)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def test_a_sharded_fit_goes_on_with_two_ranks_when_a_worker_is_lost_grows_back_and_ends_with_the_weights(
        spark_elastic, tmp_path):
    from conftest import _sessions

    cluster = _sessions.cluster
    df = H.classification_df(spark_elastic, n=384)
    store = Store(str(tmp_path / "store"))
    plain = _fit(df, store, numProc=3, minProc=2, runId="uninterrupted", model=E.Paced(seconds=0.05))
    # 3 -> 2 ranks inside epoch 1 (steps slow while 2 train, so that the worker is back in time), then 2 -> 3
    paced = E.Paced(seconds=0.05, below=3, seconds_below=1.0)
    with _LoseAndBringBack(cluster, 2, tmp_path / "store", "lost", back=True):
        lost = _fit(df, store, numProc=3, minProc=2, runId="lost", model=paced, strategy="fsdp")
    assert cluster.alive_workers() == 3
    assert lost.history[-1]["restarts"] == 1 and lost.history[-1]["grows"] == 1
    assert lost.history[1]["resumed_at_step"] in (4, 8, 12)  # at most checkpointEvery=4 steps redone
    assert [h["num_proc"] for h in lost.history][-1] == 3
    # the sharded fit, at 3, 2 then 3 ranks, trained the replicated uninterrupted 3-rank weights
    _same_weights(plain, lost)
    # a worker lost for good: the two slots left are fewer than minProc, said within startTimeout
    with _LoseAndBringBack(cluster, 1, tmp_path / "store", "starved"), pytest.raises(
            RankTimeoutError, match=r"offers 2 task slot\(s\) within startTimeout=10s, fewer than minProc=3"):
        _fit(df, store, numProc=3, minProc=3, runId="starved", model=E.Paced(seconds=0.05))
