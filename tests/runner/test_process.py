"""A rank's worker process as its task sees it: how it ended, in words; whether it only lost a peer (fast layer)."""
import pytest

from sparkring.runner.failures import is_secondary
from sparkring.runner.task.process import describe_exit


@pytest.mark.parametrize("code, words", [
    (0, "exited with code 0"), (3, "exited with code 3"), (None, "did not exit"),
    (-11, "was killed by signal 11 (SIGSEGV)"), (134, "was killed by signal 6 (SIGABRT)")])
def test_a_rank_exit_is_described_in_words(code, words):
    assert describe_exit(code) == words


def test_failures_are_read_for_their_cause():
    assert is_secondary("RuntimeError: [gloo] Connection closed by peer")
    assert not is_secondary("RuntimeError: cannot decode this image")
