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


def test_a_later_launch_removes_the_work_directories_dead_launchers_left_and_never_a_live_ones(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    from sparkring.runner.task.workdir import WorkDir

    env = dict(os.environ, TMPDIR=str(tmp_path))
    launcher = ("import sys, time; from sparkring.runner.task.workdir import WorkDir; "
                "print(WorkDir.create(int(sys.argv[1])).path, flush=True); time.sleep(120)")

    def launch(rank):
        proc = subprocess.Popen([sys.executable, "-c", launcher, str(rank)], stdout=subprocess.PIPE, text=True, env=env)
        return proc, proc.stdout.readline().strip()

    killed, killed_dir = launch(0)  # a task SIGKILLed with its executor: nothing of it cleans up
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    live, live_dir = launch(1)
    old = tmp_path / "sparkring-rank2-unclaimed"  # its launcher died before writing the owner file
    old.mkdir()
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    just_made = tmp_path / "sparkring-rank3-justmade"  # a launcher about to write it
    just_made.mkdir()
    before, tempfile.tempdir = tempfile.tempdir, str(tmp_path)
    try:
        mine = WorkDir.create(4)
    finally:
        tempfile.tempdir = before
        live.kill()
        live.wait()
    assert os.path.isdir(killed_dir) is False and not old.exists()
    assert os.path.isdir(live_dir) and just_made.exists() and os.path.isdir(mine.path)
