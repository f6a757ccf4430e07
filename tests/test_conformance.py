"""Horovod conformance: horovod.torch's contract, run the way Horovod's own tests run it
(every result against a direct computation), on gloo rings of 2 and 3 spawned processes and
on MPI rings of 2 ranks started by sparkring.run(backend="mpi") on Spark."""
from dataclasses import dataclass

import conformance_fns
import pytest
import torch
from spawn import spawn_errors, spawn_ranks

from sparkring import run


@dataclass(frozen=True)
class Ring:
    backend: str
    size: int

    def __str__(self):
        return f"{self.backend}-{self.size}"


GLOO_2, GLOO_3, MPI_2 = Ring("gloo", 2), Ring("gloo", 3), Ring("mpi", 2)
RINGS_OF_TWO = [GLOO_2, MPI_2]
EVERY_RING = [GLOO_2, GLOO_3, MPI_2]


@pytest.fixture
def on(request, _spark_sessions):
    """Runs a conformance function on the ring the test is parametrized with: results by rank."""
    ring = request.param

    def ranks(fn_name, **kwargs):
        if ring.backend == "gloo":
            return spawn_ranks("conformance_fns", fn_name, ring.size, timeout=90, **kwargs)
        _spark_sessions.get("local")
        return run(conformance_fns.__dict__[fn_name], kwargs=kwargs, num_proc=ring.size, backend="mpi", verbose=0)

    def outcomes(fn_name, **kwargs):
        """(status, traceback or result) by rank, where ranks are expected to raise."""
        if ring.backend == "gloo":
            return spawn_errors("conformance_fns", fn_name, ring.size, timeout=30, **kwargs)
        _spark_sessions.get("local")
        return run(conformance_fns.outcome, args=(fn_name,), kwargs=kwargs, num_proc=ring.size, backend="mpi",
                   verbose=0, timeout=60)

    ranks.outcomes = outcomes
    ranks.ring = ring
    return ranks


def _ranks(fn_name, size=2, **kwargs):
    return spawn_ranks("conformance_fns", fn_name, size, timeout=90, **kwargs)


def rings(*choices):
    return pytest.mark.parametrize("on", choices, ids=str, indirect=True)


@rings(*RINGS_OF_TWO)
def test_shutdown_then_init_forms_a_new_ring_while_old_objects_are_held(on):
    for r in on("reinit_twice"):
        torch.testing.assert_close(r["first"], torch.full((3,), 2.0))
        torch.testing.assert_close(r["second"], torch.full((3,), 3.0))
        assert r["third"].tolist() == [0, 1]


@rings(*EVERY_RING)
def test_every_dtype_horovod_supports_matches_a_direct_computation(on):
    results = on("every_dtype_against_a_direct_computation")
    for r in results:
        assert set(r) == {str(d) for d in conformance_fns.DTYPES}
        for dtype, ops in r.items():
            for op, (got, expected) in ops.items():
                assert got.dtype == expected.dtype, (dtype, op)
                assert torch.equal(got, expected), (dtype, op, got, expected)


@rings(*RINGS_OF_TWO)
def test_integer_average_truncates_toward_zero_and_scaling_keeps_the_dtype(on):
    for r in on("integer_average_and_scaling"):
        assert r["avg"].tolist() == [-4, 4, 10, -10] and r["avg"].dtype == torch.int32
        assert r["pre"].tolist() == [-4, 4, 10, -10]      # trunc(-1.5) + trunc(-3.0) = -1 - 3
        assert r["post"].tolist() == [-4, 4, 10, -10]
        assert r["int16"].dtype == torch.int16 and r["int16"].tolist() == [-9, 9, 21, -21]


@rings(*EVERY_RING)
def test_gradients_flow_through_collectives_as_in_horovod(on):
    results = on("gradients_through_collectives")
    size = on.ring.size
    f64 = torch.float64
    weights = [float(r + 1) for r in range(size)]
    total_w = sum(weights)
    for rank, g in enumerate(results):
        # allreduce: the gradient is the allreduce (same op) of the upstream gradients
        torch.testing.assert_close(g["allreduce_sum"], torch.full((4,), total_w, dtype=f64))
        torch.testing.assert_close(g["allreduce_avg"], torch.full((4,), total_w / size, dtype=f64))
        torch.testing.assert_close(g["grouped"][0], torch.full((2,), total_w, dtype=f64))
        torch.testing.assert_close(g["grouped"][1], torch.full((3,), 2 * total_w, dtype=f64))
        # allgather: my rows of the averaged upstream gradient (row index x the rank's weight)
        offset = sum(r + 1 for r in range(rank))
        rows = torch.arange(offset, offset + rank + 1, dtype=f64).unsqueeze(1).expand(rank + 1, 2)
        torch.testing.assert_close(g["allgather"], rows * total_w / size)
        # broadcast: the averaged gradient on the root (rank 1), zero elsewhere
        expected = torch.full((3,), total_w / size, dtype=f64) if rank == 1 else torch.zeros(3, dtype=f64)
        torch.testing.assert_close(g["broadcast"], expected)
        # alltoall: element j of my input went to rank j // 2 at position 2 * rank + j % 2
        expected = torch.tensor([(2 * rank + j % 2) * weights[j // 2] for j in range(2 * size)], dtype=f64)
        torch.testing.assert_close(g["alltoall"], expected)
        # reducescatter (Sum): Horovod multiplies the gradient by the ring size, then allgathers
        expected = torch.tensor([weights[j // 2] * size for j in range(2 * size)], dtype=f64)
        torch.testing.assert_close(g["reducescatter"], expected)


@rings(*RINGS_OF_TWO)
def test_horovods_async_grouped_and_sparse_functions_exist_and_compute_the_right_thing(on):
    r0, r1 = on("missing_functions_tour")
    for r, out in enumerate((r0, r1)):
        assert out["allgather_async"].tolist() == [0, 1, 1]
        assert [t.tolist() for t in out["grouped_allgather"]] == [[0, 1], [[0, 0], [0, 0], [1, 1], [1, 1]]]
        assert out["grouped_allgather_async"][0].tolist() == [0, 1]
        assert out["reducescatter_async"].tolist() == [3.0, 3.0]
        assert out["reducescatter_scaled"].tolist() == [3.0, 3.0]
        assert out["grouped_reducescatter"][0].tolist() == [2.0]
        assert out["grouped_reducescatter"][1].tolist() == [[2.0, 2.0]]
        assert out["grouped_reducescatter_async"][0].tolist() == [0.5]
        output, received = out["alltoall_async"]
        assert output.tolist() == [r, 10 + r] and received.tolist() == [1, 1]
        dense = torch.zeros(8)
        dense[0] += 1; dense[1] += 1; dense[5] += 4  # noqa: E702
        torch.testing.assert_close(out["sparse"], dense)
        torch.testing.assert_close(out["sparse_avg"], dense / 2)
        gloo = on.ring.backend == "gloo"
        assert out["flags"] == (gloo, not gloo, False, False, False)


@rings(*EVERY_RING)
@pytest.mark.parametrize("case,needle", [
    ("shape", r"rank 0 called allreduce, shape \(2,\) torch.float32, op Average but rank 1 called allreduce, "
              r"shape \(3,\)"),
    ("dtype", r"shape \(2,\) torch.float32.* but rank 1 called allreduce, shape \(2,\) torch.float64"),
    ("op", r"op Sum but rank 1 called allreduce, shape \(2,\) torch.float32, op Max"),
    ("root", r"rank 0 called broadcast, shape \(2,\) torch.float32, root 0 but rank 1 called broadcast, .*root 1"),
    ("name", r"the ranks passed different names"),
    ("allgather_tail", r"rank 0 called allgather, shape \(\*, 2\) torch.float32 but rank 1 called allgather, "
                       r"shape \(\*, 3\)"),
    ("kind", r"rank 0 called allreduce.* but rank 1 called allgather"),
])
def test_mismatched_arguments_raise_on_every_rank_naming_both_sides(on, case, needle):
    import re
    import time

    started = time.monotonic()
    outcomes = on.outcomes("mismatched", case=case)
    for rank, (status, text) in enumerate(outcomes):
        assert status == "error", (case, rank)
        assert "MismatchError" in text and re.search(needle, text), (case, rank, text[-600:])
    assert time.monotonic() - started < 30


@rings(*RINGS_OF_TWO)
def test_a_second_in_flight_operation_under_the_same_name_raises(on):
    for status, text in on.outcomes("mismatched", case="in_flight_name"):
        assert status == "error" and "an operation named 'x' is still in flight" in text


@rings(*RINGS_OF_TWO)
def test_optimizer_details_fresh_state_horovod_names_and_the_synchronize_warning(on):
    r0, r1 = on("optimizer_details")
    assert r0["adam_step"] == r1["adam_step"] == [1.0, 1.0]
    for a, b in zip(r0["adam_exp_avg"], r1["adam_exp_avg"]):
        torch.testing.assert_close(a, b)
    assert r0["names"] == ["allreduce.noname.0.0", "allreduce.noname.0.1"]
    assert r0["warned"] and r1["warned"]


@rings(*RINGS_OF_TWO)
@pytest.mark.parametrize("sparse_as_dense", [False, True], ids=["sparse", "as_dense"])
def test_sparse_embedding_gradients_train_like_one_process(on, sparse_as_dense):
    results = on("sparse_embedding_training", sparse_as_dense=sparse_as_dense)
    expected = conformance_fns.sparse_embedding_reference(2)
    for r in results:
        assert r["sparse_grads"] == [not sparse_as_dense] * 3
        torch.testing.assert_close(r["emb"], expected["emb"], atol=1e-6, rtol=0)
        torch.testing.assert_close(r["head"], expected["head"], atol=1e-6, rtol=0)


def test_process_sets_run_collectives_among_their_ranks_only():
    results = _ranks("process_sets_tour", 3)
    for rank, r in enumerate(results):
        assert r["ids"] == (1, 2)
        assert r["included"] == (rank in (0, 2), rank == 1)
        assert "registered already" in r["duplicate"]
        assert r["removed"] is True and r["removed_again"] is False
        assert "not registered" in r["after_remove"]
        assert r["global_sum"].item() == 3.0
    for rank in (0, 2):
        r = results[rank]
        assert (r["set_rank"], r["set_size"]) == ({0: 0, 2: 1}[rank], 2)
        assert r["sum"].item() == 2.0 and r["gather"].tolist() == [0, 2] and r["bcast"].tolist() == [20]
        assert r["alltoall"].tolist() == [0, 2] and r["rs"].tolist() == [2.0] and r["obj"] == [0, 2]
        assert r["grad"].tolist() == [4.0, 4.0]  # weights 1 and 3 of the two members
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        sum(model(torch.full((4, 3), float(m + step))).pow(2).mean() for m in (0, 2)).div(2).backward()
        opt.step()
    for rank in (0, 2):
        torch.testing.assert_close(results[rank]["weights"], model.weight.detach(), atol=1e-6, rtol=0)
    assert results[1]["alone"].item() == 5.0
    assert "rank 1 is not in" in results[1]["outsider"]


def test_a_peer_that_goes_away_raises_horovod_internal_error_on_the_survivor():
    survivor, left = _ranks("peer_loss")
    assert left == "left"
    assert survivor["type"] == "HorovodInternalError" and survivor["runtime"]
    assert survivor["message"].startswith("the collective ring broke: a peer rank went away (")
    # ranks on one host meet in shared memory, which sees the process end; gloo sees the socket close
    assert ("on this host ended while this rank waited" in survivor["message"]
            or ("Connection closed by peer" in survivor["message"] and survivor["cause"] == "RuntimeError"))
