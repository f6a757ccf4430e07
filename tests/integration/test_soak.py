"""Many runs in one session leave nothing behind: 15 back-to-back run()/fit() calls, a third
with a failing rank, each result checked, and the driver's and executors' footprint
(processes, threads, open files, listening sockets) no larger at the end than after the first."""
import est_helpers as H
import pytest
import rank_fns
from leftovers import footprint, settled_footprint

from sparkring import RankFailedError, SparkRingEstimator, Store, run


def _fit(spark, store, run_id, failing):
    est = SparkRingEstimator(model=H.ForwardFails() if failing else H.mlp(), optimizer=H.adam, loss="cross_entropy",
                             batchSize=32, epochs=1, numProc=2, store=store, runId=run_id, verbose=0)
    return est.fit(H.classification_df(spark, n=192))


def _one_call(spark, store, i):
    """Call i of the soak: every third one fails; every fifth one is a fit()."""
    failing = i % 3 == 2
    if i % 5 == 4:
        if failing:
            with pytest.raises(RankFailedError, match="forward fails on purpose"):
                _fit(spark, store, f"soak-{i}", failing=True)
        else:
            model = _fit(spark, store, f"soak-{i}", failing=False)
            assert len(model.history) == 1 and model.history[0]["loss"] > 0
        return
    if failing:
        with pytest.raises(RankFailedError, match=f"boom on purpose in rank {i % 2}"):
            run(rank_fns.fail_on_rank, args=(i % 2,), num_proc=2, verbose=0)
    else:
        assert [r["rank"] for r in run(rank_fns.whoami, num_proc=2, verbose=0)] == [0, 1]


def test_fifteen_runs_and_fits_a_third_failing_leave_no_growing_footprint(spark, tmp_path):
    store = Store(str(tmp_path / "store"))
    # warm up with one of each kind: Spark starts a Python daemon per kind of job the first time
    for i in range(5):
        _one_call(spark, store, i)
    before = settled_footprint(footprint(), timeout=5)
    for i in range(5, 20):
        _one_call(spark, store, i)
    after = settled_footprint(before, timeout=20, slack_fds=4)
    assert after.workers == 0, after
    assert not after.grown(before, slack_fds=4), f"grew over 15 runs: {after.grown(before, slack_fds=4)}"
