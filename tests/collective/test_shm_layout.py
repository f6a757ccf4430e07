"""How ranks group by host for the shared-memory ring, and how it tells that a peer is gone (fast layer)."""
def test_host_layout_groups_ranks_by_host_with_the_first_rank_of_each_leading():
    from sparkring.collective._shm import HostLayout

    layouts = HostLayout.of(["b", "a", "b", "a", "c"])
    assert [lay.local_ranks for lay in layouts] == [[0, 2], [1, 3], [0, 2], [1, 3], [4]]
    assert layouts[0].leaders == [0, 1, 4]


def test_a_killed_process_counts_as_gone_before_its_parent_reaps_it():
    import os
    import signal
    import subprocess
    import sys

    from waiting import wait_until

    from sparkring.collective._shm import _process_start

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _process_start(child.pid) is not None and _process_start(os.getpid()) is not None
        os.kill(child.pid, signal.SIGKILL)
        wait_until(lambda: _process_start(child.pid) is None, timeout=5)  # a zombie until wait() below
        assert _process_start(child.pid) is None
        assert open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        child.kill()
        child.wait()
    assert _process_start(child.pid) is None
