"""Allreduce between ranks of one host through shared memory, hierarchical across hosts:
results against direct computations, bitwise equal across ranks, the fallbacks, and
/dev/shm left as found whatever happens."""
import os
import pickle
import signal

import pytest
import shm_fns
import torch
from spawn import _start, spawn_errors, spawn_ranks

from sparkring.collective import _shm

TWO_HOSTS = {0: {"SPARKRING_HOST_ID": "host-a"}, 1: {"SPARKRING_HOST_ID": "host-a"},
             2: {"SPARKRING_HOST_ID": "host-b"}, 3: {"SPARKRING_HOST_ID": "host-b"}}


def _segments():
    return sorted(n for n in os.listdir(_shm.SHM_DIR) if n.startswith(_shm.NAME_PREFIX))


@pytest.fixture
def shm_left_as_found():
    before = _segments()
    yield
    assert _segments() == before


@pytest.mark.parametrize("size", [2, 3])
def test_every_op_and_dtype_equals_a_direct_computation_bitwise_on_every_rank(size, shm_left_as_found):
    results = spawn_ranks("shm_fns", "every_op_and_dtype", size, timeout=240)
    assert all(on_shm for on_shm, _ in results)
    assert [out.pop("hosts") for _, out in results] == [1] * size
    _assert_bitwise_equal([out for _, out in results])


def _assert_bitwise_equal(outs):
    first = outs[0]
    for other in outs[1:]:
        assert other.keys() == first.keys()
        for key, value in first.items():
            values = value if isinstance(value, list) else [value]
            for a, b in zip(values, other[key] if isinstance(value, list) else [other[key]]):
                assert a.dtype == b.dtype and torch.equal(a, b), key  # bitwise: NaN-free inputs


def test_two_hosts_of_two_ranks_reduce_hierarchically_equal_on_every_rank(shm_left_as_found):
    # each rank checks its results against the direct computation (float sums within rounding:
    # the hosts add their partials first)
    results = spawn_ranks("shm_fns", "every_op_and_dtype", 4, timeout=300, rank_env=TWO_HOSTS, exact=False)
    assert all(on_shm for on_shm, _ in results)
    assert [out.pop("hosts") for _, out in results] == [2] * 4
    _assert_bitwise_equal([out for _, out in results])


def test_one_rank_per_host_keeps_the_gloo_path():
    one_each = {r: {"SPARKRING_HOST_ID": f"host-{r}"} for r in range(2)}
    results = spawn_ranks("shm_fns", "rank_is_late", 2, timeout=60, rank_env=one_each, delay=0)
    assert results == [False, False]


def test_distributed_optimizer_on_shared_memory_ends_with_the_weights_of_one_process(shm_left_as_found):
    results = spawn_ranks("shm_fns", "optimizer_steps", 2, timeout=90)
    reference = shm_fns.optimizer_reference(2)
    for on_shm, weights in results:
        assert on_shm
        for name, value in reference.items():
            torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=0)


def test_across_hosts_the_buckets_reduce_on_the_rings_thread_in_order_with_the_callers_allreduces(
        shm_left_as_found):
    results = spawn_ranks("shm_fns", "optimizer_steps_with_a_foreground_allreduce", 4, timeout=120,
                          rank_env=TWO_HOSTS)
    reference = shm_fns.optimizer_reference(4)
    for on_shm, weights, sums, threads in results:
        assert on_shm and "sparkring host ring" in threads, threads  # backward went on while they ran
        assert sums == [6.0 + 4 * step for step in range(5)]  # 0+1+2+3, then one more per rank each step
        for name, value in reference.items():
            torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=0)


def test_join_with_uneven_batches_works_on_shared_memory(shm_left_as_found):
    results = spawn_ranks("shm_fns", "join_uneven", 2, timeout=90)
    on_gloo = spawn_ranks("shm_fns", "join_uneven", 2, timeout=90, rank_env={r: {"SPARKRING_SHM": "0"} for r in (0, 1)})
    assert [on_shm for on_shm, _, _ in results] == [True, True] and [s for s, _, _ in on_gloo] == [False, False]
    assert [last for _, last, _ in results] == [1, 1]  # the rank that joined last
    for (_, _, weight), (_, _, reference) in zip(results, on_gloo):  # join's semantics, unchanged
        torch.testing.assert_close(weight, reference, atol=1e-7, rtol=0)


def test_a_rank_killed_mid_run_fails_its_peer_fast_and_leaves_no_segment(shm_left_as_found):
    procs, queue = _start("shm_fns", "rank_dies", 2, {})
    try:
        rank, kind, data = queue.get(timeout=60)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert (rank, kind) == (0, "ok"), data
    name, message, waited = pickle.loads(data)
    assert name == "HorovodInternalError" and "peer rank went away" in message, message
    assert waited < 20
    assert procs[1].exitcode == -signal.SIGKILL


def test_a_late_rank_within_the_timeout_is_waited_for_and_past_it_raises(shm_left_as_found):
    assert spawn_ranks("shm_fns", "rank_is_late", 2, timeout=60, delay=1.5) == [True, True]
    env = {r: {"SPARKRING_COLLECTIVE_TIMEOUT": "2"} for r in range(2)}
    outcomes = spawn_errors("shm_fns", "rank_is_late", 2, timeout=60, rank_env=env, delay=4, straight_to_the_ring=True)
    kind, tb = outcomes[0]
    assert kind == "error" and "HorovodInternalError: shared-memory allreduce: waited 2s at 'arrive'" in tb, tb


def test_a_rank_waiting_at_the_ring_for_a_late_peer_sleeps_instead_of_spinning(shm_left_as_found):
    # with more busy threads than cores (a decoding thread beside each rank) a spinning waiter
    # would take the core its late peer needs
    (share, summed), (_, peer_summed) = spawn_ranks("shm_fns", "waiting_cpu_share", 2, timeout=60, delay=1.0)
    assert summed and peer_summed
    assert share < 0.2, f"the waiting rank used {share:.0%} of a core"


def test_async_operations_in_other_orders_negotiate_through_shared_memory(shm_left_as_found):
    # Horovod's async calls meet in a negotiation round; on one host it takes the segment (a few
    # copies), not gloo's pickled all_gather_object (milliseconds a round)
    results = spawn_ranks("shm_fns", "async_ops_in_other_orders", 2, timeout=60)
    for values, gloo_rounds in results:
        assert values == {"a": [1.0] * 5, "b": [3.0] * 5, "c": [5.0] * 5}
        assert gloo_rounds == 0


def test_any_rank_that_cannot_use_shared_memory_sends_every_rank_through_gloo(shm_left_as_found, capfd):
    results = spawn_ranks("shm_fns", "every_op_and_dtype", 2, timeout=240, rank_env={1: {"SPARKRING_SHM": "0"}})
    assert [on_shm for on_shm, _ in results] == [False, False]
    warnings = [line for line in capfd.readouterr().err.splitlines() if "not shared memory" in line]
    assert warnings == ["allreduce between ranks on one host goes through gloo, not shared memory: rank 1: "
                        "SPARKRING_SHM=0"]  # one line, from rank 0


def test_a_small_dev_shm_is_refused_with_the_way_to_raise_it(monkeypatch):
    real = os.statvfs(_shm.SHM_DIR)

    class Small:
        f_frsize = real.f_frsize
        f_bavail = (4 * 2**20) // real.f_frsize

    monkeypatch.setattr(_shm.os, "statvfs", lambda path: Small)
    reason = _shm.unusable_reason(local_size=2)
    assert reason.startswith(f"{_shm.SHM_DIR} has 4 MiB free and the ring needs 6 MiB") and "--shm-size" in reason
    monkeypatch.setenv("SPARKRING_SHM", "0")
    assert _shm.unusable_reason(local_size=2) == "SPARKRING_SHM=0"


@pytest.mark.compat
def test_run_and_fit_use_shared_memory_unless_told_not_to(spark):
    import est_helpers as H

    from sparkring import SparkRingEstimator, run

    assert run(shm_fns.ring_in_use, num_proc=2, verbose=0) == [True, True]
    assert run(shm_fns.ring_in_use, num_proc=2, verbose=0, shared_memory=False) == [False, False]
    for shared in (True, False):
        est = SparkRingEstimator(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", epochs=1, numProc=2,
                                 verbose=0, sharedMemory=shared, callbacks=[shm_fns.ExpectRing(shared)])
        assert len(est.fit(H.classification_df(spark, n=64)).history) == 1
