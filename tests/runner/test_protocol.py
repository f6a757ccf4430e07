"""The runner's vocabulary on its own: frames and output records survive every way they travel, and a
rank's exception keeps its type from the worker to the driver's RankFailedError."""
import pytest

from sparkring.errors import NonFiniteLossError, RankFailedError, type_name
from sparkring.runner import protocol
from sparkring.runner.protocol import MESSAGE, RESULT, Error, OutputRecord


def test_an_error_keeps_the_type_its_rank_raised_over_the_wire_and_inside_a_task_failure():
    err = Error(rank=1, attempt=0, kind=protocol.EXCEPTION, traceback="Traceback ...",
                exception_type=type_name(NonFiniteLossError),
                message="non-finite loss nan at epoch 0, step 3 on rank 1")
    assert protocol.loads(protocol.dumps(err)) == err
    assert protocol.found_error("Job aborted: RuntimeError: rank 1 failed " + protocol.embed_error(err)) == err
    failed = RankFailedError(err.rank, err.traceback, exception_type=err.exception_type, message=err.message)
    assert failed.raised(NonFiniteLossError) and not failed.raised(FloatingPointError)
    assert not RankFailedError(0, "FloatingPointError: non-finite loss nan").raised(NonFiniteLossError)


def test_output_records_reassemble_a_result_from_its_chunks_and_replay_messages():
    pytest.importorskip("pyarrow")
    import cloudpickle

    from sparkring.runner.driver.stage import StageOutcome

    chunks = OutputRecord.result_chunks(0, cloudpickle.dumps({"weights": list(range(1000))}), chunk=100)
    assert len(chunks) > 1 and {c.kind for c in chunks} == {RESULT}
    rows = [OutputRecord.from_row(c.to_arrow().to_pylist()[0]) for c in chunks]  # as Spark hands them back
    done = OutputRecord.message(0, protocol.Done(rank=0, attempt=0))
    outcome = StageOutcome(records=list(reversed(rows)) + [done])
    assert outcome.results(1) == [{"weights": list(range(1000))}]
    assert [r.kind for r in outcome.messages()] == [MESSAGE] and outcome.messages()[0].frame() == done.frame()
    with pytest.raises(Exception, match="rank 0's result came back incomplete"):
        StageOutcome(records=rows[1:]).results(1)
