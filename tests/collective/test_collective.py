"""sparkring.collective on two real ranks (local[2]) and in a single process."""
import pytest
import rank_fns
import torch
from spawn import spawn_ranks

import sparkring.collective as sr
from sparkring import run


def _assert_state_close(a, b, atol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0)


@pytest.mark.compat
def test_two_ranks_with_half_batches_end_with_weights_of_one_process_on_whole_batches(spark):
    expected = rank_fns.train_reference(steps=4)
    results = run(rank_fns.train_distributed, kwargs={"steps": 4}, num_proc=2)
    for state in results:
        _assert_state_close(state, expected, atol=1e-6)


def test_an_lr_scheduler_made_before_the_wrap_still_steps_through_the_allreduce(spark):
    expected = rank_fns.train_reference(steps=4)
    results = run(rank_fns.train_distributed, kwargs={"steps": 4, "scheduler_first": True}, num_proc=2)
    for state in results:
        _assert_state_close(state, expected, atol=1e-6)


def test_small_buckets_give_the_same_weights_as_one_bucket(spark):
    expected = rank_fns.train_reference(steps=3)
    results = run(rank_fns.train_distributed, kwargs={"steps": 3, "bucket_bytes": 64}, num_proc=2)
    _assert_state_close(results[0], expected, atol=1e-6)


def test_fp16_compression_stays_within_fp16_tolerance(spark):
    expected = rank_fns.train_reference(steps=4)
    results = run(rank_fns.train_distributed, kwargs={"steps": 4, "compression": "fp16"}, num_proc=2)
    _assert_state_close(results[0], expected, atol=5e-3)
    _assert_state_close(results[0], results[1], atol=0)


def test_backward_passes_per_step_two_equals_manual_accumulation(spark):
    expected = rank_fns.train_reference(bpps=2, steps=3)
    results = run(rank_fns.train_distributed, kwargs={"bpps": 2, "steps": 3}, num_proc=2)
    for state in results:
        _assert_state_close(state, expected, atol=1e-6)


def test_gradients_zeroed_in_place_accumulate_straight_into_the_reduction_buffers(spark):
    # zero_grad(set_to_none=False) keeps the grads that synchronize() pointed into the bucket
    # buffers, so backward accumulates there and nothing is copied; results must not change
    expected = rank_fns.train_reference(bpps=2, steps=3, set_to_none=False)
    results = run(rank_fns.train_distributed, kwargs={"bpps": 2, "steps": 3, "bucket_bytes": 64,
                                                      "set_to_none": False, "report_grad_storage": True},
                  num_proc=2)
    for state in results:
        assert state.pop("grads_in_buffers")
        _assert_state_close(state, expected, atol=1e-6)


def test_collectives_handle_odd_sizes_empty_int_and_float64_tensors(spark):
    r0, r1 = run(rank_fns.collectives_tour, num_proc=2)
    base = torch.arange(7, dtype=torch.float32)
    assert (r0["rank"], r1["rank"], r0["size"], r0["local_size"]) == (0, 1, 2, 2)
    assert r0["backend"] == "gloo"
    for r in (r0, r1):
        torch.testing.assert_close(r["avg_odd"], base + 0.5)
        torch.testing.assert_close(r["sum_odd"], 2 * base + 1)
        torch.testing.assert_close(r["min"], base)
        torch.testing.assert_close(r["max"], base + 1)
        assert r["empty"].numel() == 0
        assert r["int_sum"].dtype == torch.int32 and r["int_sum"].tolist() == [3, 6, 9]
        assert r["f64"].dtype == torch.float64
        torch.testing.assert_close(r["f64"], torch.tensor([0.3, 0.6], dtype=torch.float64))
        assert r["inplace"].tolist() == [3.0, 3.0, 3.0]
        assert r["async"].tolist() == [1.0] * 5
        assert r["gather"].tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert r["bcast"].tolist() == [11]
        assert r["bobj"] == {"from": 0}
        assert r["gobj"] == [("rank", 0), ("rank", 1)]
    torch.testing.assert_close(r1["odd_untouched"], base + 1)  # allreduce is out of place


def test_broadcast_optimizer_state_copies_tensors_step_counters_and_lr(spark):
    r0, r1 = run(rank_fns.optimizer_state_tour, num_proc=2)
    assert r1["lr"] == r0["lr"] == pytest.approx(0.01)
    assert r1["step"] == r0["step"] == 1.0
    torch.testing.assert_close(r1["exp_avg"], r0["exp_avg"], atol=0, rtol=0)
    torch.testing.assert_close(r1["weight"], r0["weight"], atol=0, rtol=0)


def test_two_optimizers_over_one_model_match_single_process(spark):
    model = rank_fns.make_model()
    x, y = rank_fns.make_batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    r0, r1 = run(rank_fns.two_optimizers, num_proc=2)
    _assert_state_close(r0, model.state_dict(), atol=1e-6)
    _assert_state_close(r1, model.state_dict(), atol=1e-6)


def test_synchronize_then_skip_synchronize_exposes_averaged_gradients(spark):
    g0, g1 = run(rank_fns.clip_then_step, num_proc=2)
    model = rank_fns.make_model()
    x, y = rank_fns.make_batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    for a, b, p in zip(g0, g1, model.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-6, rtol=0)
        torch.testing.assert_close(b, p.grad, atol=1e-6, rtol=0)


@pytest.fixture
def single_rank():
    sr.init()
    yield
    sr.shutdown()


def test_duplicate_parameter_names_are_rejected(single_rank):
    model = rank_fns.make_model()
    named = [("same", p) for p in model.parameters()]
    with pytest.raises(ValueError, match="duplicate names"):
        sr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named)


def test_wrapped_optimizer_is_still_an_instance_of_its_class_for_lr_schedulers(single_rank):
    model = rank_fns.make_model()
    opt = sr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_single_process_ring_without_a_runner(single_rank):
    assert (sr.rank(), sr.size(), sr.backend()) == (0, 1, "gloo")
    torch.testing.assert_close(sr.allreduce(torch.ones(3)), torch.ones(3))
    assert sr.allgather(torch.ones(2, 2)).shape == (2, 2)


def test_collective_before_init_says_to_call_init():
    sr.shutdown()
    with pytest.raises(sr.NotInitializedError, match="init"):
        sr.rank()


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.slow
def test_out_of_place_allreduce_of_large_odd_tensors_matches_a_direct_computation(size):
    results = spawn_ranks("rank_fns", "large_out_of_place_allreduce", size)
    xs = torch.stack([r["x"] for r in results])
    expected = {"Sum": xs.sum(0), "Average": xs.mean(0), "Min": xs.min(0).values,
                "Max": xs.max(0).values, "Product": xs.prod(0)}
    ys = torch.stack([r["y"] for r in results])
    int_sum = torch.stack([r["xi"] for r in results]).sum(0, dtype=torch.int32)
    z_max = torch.stack([r["z"] for r in results]).max(0).values
    for r in results:
        assert r["direct"] and r["untouched"] and r["first_intact"]
        assert r["algorithms"] == ({"swap", "ring"} if size == 2 else {"ring"})
        assert torch.equal(r["z_max"], z_max)
        assert r["in_place_is_same_tensor"] and torch.equal(r["y_max_in_place"], ys.max(0).values)
        for op in expected:  # every rank holds bitwise the same result
            assert torch.equal(r[op], results[0][op])
        for op, want in expected.items():
            torch.testing.assert_close(r[op], want, rtol=1e-12, atol=1e-12)
        assert r["int_sum"].dtype == torch.int32 and torch.equal(r["int_sum"], int_sum)
        assert r["y_avg"].shape == (3, 180_001)
        torch.testing.assert_close(r["y_avg"], ys.mean(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["second"], 2 * ys.sum(0), rtol=1e-5, atol=1e-5)


def test_across_hosts_gradients_travel_in_about_eight_buckets_and_on_one_host_in_ddps_25_mb():
    from sparkring.collective.optimizer import DistributedOptimizerMixin

    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(10)])  # 10.5 MB of gradients
    params = list(blocks.parameters())

    def sizes(hosts):
        return [sum(p.numel() * 4 for p in b.params) for b in DistributedOptimizerMixin._sr_make_buckets(
            params, None, hosts)]

    across, one_host = sizes(2), sizes(1)
    # the last bias first (what backward reaches first starts early); then across hosts a block a bucket (about
    # an eighth of the gradients): its exchange starts while backward computes the blocks below; on one host
    # everything else in one bucket of at most DDP's 25 MB
    assert across[0] == one_host[0] == 512 * 4 and sum(across) == sum(one_host) == 10 * (512 * 512 + 512) * 4
    assert len(across) == 11 and max(across) < 1.1 * 2**20
    assert len(one_host) == 2
