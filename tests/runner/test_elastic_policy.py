"""The elastic loop's decisions on their own (no Spark): what a launch's end means, by ElasticPolicy."""
import pytest

from sparkring.collective.elastic import Relaunches, StopAsk, StopRequest
from sparkring.errors import RankFailedError, StageLostError
from sparkring.runner.driver.elastic import Done, ElasticLaunch, ElasticPolicy, Relaunch


class _Policy(ElasticPolicy):
    def is_paused(self, results):
        return results == ["paused"]

    def is_final(self, exc):
        return "final" in str(exc)


HOW = ElasticLaunch(target_size=3, min_size=2, max_restarts=2, start_timeout=5)


def test_results_that_did_not_pause_end_the_run():
    assert _Policy(HOW).after_results(["r0", "r1"], StopAsk.NOTHING, Relaunches()) == Done(["r0", "r1"])


def test_ranks_that_stopped_when_asked_go_on_growing_or_leaving_and_are_counted():
    grow = _Policy(HOW).after_results(["paused"], StopAsk.GROW, Relaunches(restarts=1))
    assert grow == Relaunch("the slots are back", Relaunches(restarts=1, grows=1))
    leave = _Policy(HOW).after_results(["paused"], StopAsk.LEAVE, Relaunches())
    assert leave.counts == Relaunches(decommissions=1) and leave.wait is False  # that executor is not coming back


def test_a_loss_relaunches_until_the_restarts_are_spent_and_a_final_failure_is_raised_at_once():
    lost = StageLostError("gone", lost={2: "10.0.0.7:41113"})
    first = _Policy(HOW).after_failure(lost, Relaunches())
    assert first.counts == Relaunches(restarts=1) and first.lost is lost and first.wait
    assert first.cause == "lost rank 2 (executor 10.0.0.7:41113)" and first.note == " (restart 1 of at most 2)"
    with pytest.raises(StageLostError):
        _Policy(HOW).after_failure(lost, Relaunches(restarts=2))
    with pytest.raises(RankFailedError, match="final"):
        _Policy(HOW).after_failure(RankFailedError(0, "final"), Relaunches())


def test_a_stop_request_reads_back_what_the_driver_asked(tmp_path):
    request = StopRequest(str(tmp_path / "stop-request"))
    assert request.read() is StopAsk.NOTHING
    request.make(StopAsk.LEAVE)
    assert request.read() is StopAsk.LEAVE and int(request.read()) == 2  # an int on the wire and in the broadcast
    request.clear()
    assert request.read() is StopAsk.NOTHING


def test_with_several_ranks_per_task_a_relaunch_counts_whole_tasks(monkeypatch):
    from sparkring.runner.driver import elastic

    how = ElasticLaunch(target_size=6, min_size=2, max_restarts=2, start_timeout=5, ranks_per_task=2)
    assert [how.ranks_in(slots) for slots in (0, 1, 2, 3, 4)] == [0, 2, 4, 6, 6]
    # a lost task of two ranks leaves two task slots: the next launch has four ranks, at once
    monkeypatch.setattr(elastic, "registered_slots", lambda spark: 2)
    monkeypatch.setattr(elastic, "wait_for_slots", lambda spark, wanted, timeout: True)
    assert elastic._size_for_next_launch(None, how, "lost ranks 4, 5", None, wait=True) == 4
    monkeypatch.setattr(elastic, "registered_slots", lambda spark: 0)
    with pytest.raises(elastic.RankTimeoutError, match="offers 0 rank"):
        elastic._size_for_next_launch(None, how, "lost ranks 0-5", None, wait=False)
