"""Two simulated hosts on this machine (tests/helpers/sim_hosts.py: network namespaces with their
own hostnames and /dev/shm, 1 Gbit/s links through a bridge, a standalone worker on each, the
master and the driver on a head of their own): ranks land on both hosts, the hierarchical
allreduce equals the flat one, a fit equals the same fit on one host (and names host 1 as the
straggler when its link runs at a tenth of host 0's), and a host cut off the
network or whose packets are all dropped reaches the caller within the heartbeat timeout, named; an
elastic fit goes on without a host cut off as without one whose executor is killed; MPI (MPICH)
puts ranks on both hosts."""
import os
import re
import time

import pytest
from sim_hosts import Link, SimulatedHosts, why_not

pytestmark = [pytest.mark.slow, pytest.mark.cluster,
              pytest.mark.skipif(why_not() is not None, reason=str(why_not()))]
HEARTBEAT_S = 8.0


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Two hosts, 1 Gbit/s each, a 2-core worker on each; torn down after the module."""
    root = str(tmp_path_factory.mktemp("simulated-hosts"))
    made = SimulatedHosts(2, Link("1gbit")).start()
    try:
        made.cluster = made.spark_cluster(root, dict(os.environ), cores=2)
        yield made
    finally:
        made.stop()


def test_ranks_land_on_both_hosts_and_the_hierarchical_flat_and_mpi_allreduces_agree(hosts):
    seen = hosts.cluster.drive("layout", {"floats": 100_000, "ranks": 4})
    expected = 10 * sum(range(100_000))  # ranks 0..3 add i * (rank + 1)
    for how in ("hierarchical", "flat", "mpi"):  # mpi: MPICH, its ranks joined across the hosts
        ranks = seen[how]
        assert sorted(r["host"] for r in ranks) == ["simhost0", "simhost0", "simhost1", "simhost1"], how
        assert {r["checksum"] for r in ranks} == {expected}, how
    assert all(r["local_size"] == 2 and r["cross_size"] == 2 for r in seen["hierarchical"] + seen["flat"])
    assert [r["total"] for r in seen["hierarchical"]] == [r["total"] for r in seen["flat"]]


def test_a_fit_across_two_hosts_reaches_the_weights_of_the_same_fit_on_one_host_and_names_a_slow_link(
        hosts, tmp_path):
    said = []
    hosts.shape(1, Link("100mbit"))  # a tenth of host 0's link
    try:
        across = hosts.cluster.drive("fit", {"ranks": 4, "store": str(tmp_path / "across")},
                                     on_line=said.append)["weights"]
    finally:
        hosts.shape(1, Link("1gbit"))
    # the driver timed each host's probe: host 1, a tenth of host 0's rate, is named (ranks' comm times cannot tell)
    named = [line for line in said if "straggler: host" in line]
    assert len(named) == 1 and "host simhost1's link" in named[0], said[-20:]
    assert 0 < float(re.search(r"([0-9.]+)x the other hosts'", named[0]).group(1)) < 0.5, named
    one_host = hosts.cluster.drive("fit", {"ranks": 4, "store": str(tmp_path / "one")}, master="local[4]")["weights"]
    assert across.keys() == one_host.keys()
    for name in across:
        assert across[name] == pytest.approx(one_host[name], abs=1e-5), name


@pytest.mark.parametrize("how", ["cut", "drop"])
def test_a_host_cut_off_mid_allreduce_reaches_the_caller_within_the_heartbeat_timeout_named(hosts, tmp_path, how):
    lost_at = []

    def lose_host_one_once_allreducing(line):
        if "allreducing" in line and not lost_at:
            time.sleep(1.0)
            getattr(hosts, how)(1)  # its link down, or every packet to and from it dropped
            lost_at.append(time.time())

    try:
        seen = hosts.cluster.drive("cut", {"ranks": 4, "flag": str(tmp_path / "never"),
                                           "heartbeat_timeout": HEARTBEAT_S, "timeout": 600},
                                   on_line=lose_host_one_once_allreducing)
    finally:
        hosts.heal(1)
        hosts.cluster.wait_idle(timeout=120)
    assert lost_at, "the ranks never said they were allreducing"
    assert seen["error"] == "HostLostError", seen
    assert list(seen["hosts"].values()) == [hosts.address(1)] * 2  # both ranks of host 1, and only they
    assert f"on host {hosts.address(1)}" in seen["message"] and "heartbeat_timeout=8s" in seen["message"]
    # the timeout after the host's last beat, plus the watch's round: far from the 600 s timeout
    assert seen["at"] - lost_at[0] < HEARTBEAT_S + 10


def test_an_elastic_fit_goes_on_without_a_host_cut_off_as_without_one_whose_executor_is_killed(hosts, tmp_path):
    cut_loss = hosts.cluster.elastic_fit_losing_host(1, "cut", str(tmp_path / "cut"), HEARTBEAT_S)
    killed_loss = hosts.cluster.elastic_fit_losing_host(1, "kill_worker", str(tmp_path / "killed"), HEARTBEAT_S)
    for loss in (cut_loss, killed_loss):
        assert loss.lost_at and loss.going_on_at and loss.resumed_at, loss
    cut, killed = cut_loss.result, killed_loss.result
    for seen in (cut, killed):
        assert [h["num_proc"] for h in seen["history"]] == [4, 2, 2]
        assert [h["restarts"] for h in seen["history"]] == [0, 1, 1]
        assert seen["history"][1]["resumed_at_step"] in (4, 8)  # at most checkpointEvery=4 steps redone
    # the silent host is given up on after heartbeatTimeout, then the two ranks left go on
    assert cut_loss.going_on_at - cut_loss.lost_at < HEARTBEAT_S + 10
    for name in cut["weights"]:
        assert cut["weights"][name] == pytest.approx(killed["weights"][name], abs=1e-5), name
