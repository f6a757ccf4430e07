"""Rank functions for the shared-memory allreduce tests (run by tests/helpers/spawn.py)."""
import os
import signal
import time

import torch

import sparkring.collective as sr
from sparkring.collective._runtime import state

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64]
OPS = {"sum": (sr.Sum, torch.add), "min": (sr.Min, torch.minimum), "max": (sr.Max, torch.maximum),
       "product": (sr.Product, torch.mul)}
# 0, 1, odd, larger than the whole segment of 2 ranks (8 chunks of 2 MiB: 2M float64 = 16 MiB)
SIZES = [0, 1, 7, 1001, 2_000_001]


def on_shared_memory():
    return state.backend._host_ring is not None


def hosts_seen():
    """How many hosts this rank's shared-memory ring spans."""
    ring = state.backend._host_ring
    return 0 if ring is None else ring.hosts


def _input(rank, n, dtype, op):
    g = torch.Generator().manual_seed(1000 * rank + n)
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g) * (0.5 if op == "product" else 4)
    else:
        x = torch.randint(-3 if dtype != torch.uint8 else 0, 4, (n,), generator=g)
    return x.to(dtype)


def every_op_and_dtype(exact=True):
    """Each result is checked against the direct computation in rank order here (float sums
    and products within rounding where ``exact`` is False: hosts add their partials first);
    the results come back so the test compares them across ranks bitwise."""
    out = {}
    size = sr.size()
    for op, (sr_op, combine) in OPS.items():
        for dtype in DTYPES:
            sizes = SIZES if op == "sum" else SIZES[:4]
            for n in sizes:
                got = sr.allreduce(_input(sr.rank(), n, dtype, op), op=sr_op)
                want = _input(0, n, dtype, op)
                for k in range(1, size):
                    want = combine(want, _input(k, n, dtype, op))
                assert got.dtype == dtype, (op, dtype, n)
                if exact or not dtype.is_floating_point or op in ("min", "max"):
                    assert torch.equal(got, want), (op, dtype, n)
                else:
                    # a few units in the last place of values up to ~|16|
                    ulps = 16 * 4 * torch.finfo(dtype).eps
                    torch.testing.assert_close(got.double(), want.double(), rtol=ulps, atol=ulps)
                out[(op, str(dtype), n)] = got
    # in place, and a non-contiguous input (a transposed matrix)
    t = _input(sr.rank(), 3000, torch.float32, "sum").reshape(60, 50).t()
    want = sum(_input(k, 3000, torch.float32, "sum").reshape(60, 50).t() for k in range(size))
    same = sr.allreduce_(t, op=sr.Sum)
    assert same is t and not t.is_contiguous()
    torch.testing.assert_close(t, want, rtol=0, atol=0 if exact else 1e-5)
    grouped = sr.grouped_allreduce([_input(sr.rank(), 5, torch.float32, "sum"),
                                    _input(sr.rank(), 9, torch.int32, "sum")], op=sr.Sum)
    out["grouped"] = grouped
    out["average"] = sr.allreduce(_input(sr.rank(), 101, torch.float32, "sum"))
    out.update(broadcasts())
    out["hosts"] = hosts_seen()
    return on_shared_memory(), out


def broadcasts():
    """Broadcast from every root, of every dtype (bool and complex too: bytes on one host), of
    sizes past the segment, non-contiguous, into parameters that require grad: each equals the
    root's tensor."""
    out = {}
    for root in range(sr.size()):
        for dtype in DTYPES + [torch.bool, torch.complex64]:
            for n in SIZES[1:] if dtype == torch.float64 else SIZES[1:4]:
                mine = _input(sr.rank(), n, torch.float64 if dtype == torch.complex64 else dtype, "sum").to(dtype)
                got = sr.broadcast(mine, root_rank=root)
                want = _input(root, n, torch.float64 if dtype == torch.complex64 else dtype, "sum").to(dtype)
                assert got.dtype == dtype and torch.equal(got, want), (root, dtype, n)
                out[("bcast", root, str(dtype), n)] = got
        strided = _input(sr.rank(), 3000, torch.float32, "sum").reshape(60, 50).t()
        sr.broadcast_(strided, root_rank=root)
        assert torch.equal(strided, _input(root, 3000, torch.float32, "sum").reshape(60, 50).t())
        net = torch.nn.Linear(40, 30)
        torch.nn.init.constant_(net.weight, float(sr.rank()))
        sr.broadcast_parameters(net.named_parameters(), root_rank=root)
        assert torch.equal(net.weight, torch.full((30, 40), float(root))) and net.weight.requires_grad
    return out


def optimizer_steps(between_backward_and_step=None):
    """DistributedOptimizer on an MLP over this ring: the final weights (the test compares
    them with one process on the whole batch); ``between_backward_and_step(step)`` runs where
    the buckets' allreduces may still be in flight."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    opt = sr.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
    sr.broadcast_parameters(net.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)
    part = slice(sr.rank() * 64 // sr.size(), (sr.rank() + 1) * 64 // sr.size())
    for step in range(5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[part]), y[part]).backward()
        if between_backward_and_step is not None:
            between_backward_and_step(step)
        opt.step()
    return on_shared_memory(), {k: v.clone() for k, v in net.state_dict().items()}


def optimizer_steps_with_a_foreground_allreduce():
    """optimizer_steps, with an allreduce of the caller's between backward and step (while the buckets'
    allreduces may still run): the final weights, that allreduce's results, and the threads the host
    ring's allreduces ran on."""
    import threading

    from sparkring.collective._shm import HostRing

    threads = set()
    here = HostRing._allreduce_here

    def recorded(self, source, out, op):
        threads.add(threading.current_thread().name)
        return here(self, source, out, op)

    HostRing._allreduce_here = recorded
    sums = []
    on_shm, weights = optimizer_steps(
        lambda step: sums.append(sr.allreduce(torch.full((1000,), float(sr.rank() + step)), op=sr.Sum)[0].item()))
    return on_shm, weights, sums, sorted(threads)


def optimizer_reference(size):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)
    for _ in range(5):
        opt.zero_grad()
        # the mean of the ranks' mean losses (equal shares)
        shares = [slice(r * 64 // size, (r + 1) * 64 // size) for r in range(size)]
        loss = sum(torch.nn.functional.cross_entropy(net(x[share]), y[share]) for share in shares) / size
        loss.backward()
        opt.step()
    return net.state_dict()


def join_uneven():
    """Rank r runs 3 + r batches; join() lets the ranks that finish early answer the others'
    allreduces with zeros."""
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    opt = sr.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
    for step in range(3 + sr.rank()):
        opt.zero_grad()
        net(torch.full((4, 8), float(step + 1))).sum().backward()
        opt.step()
    last = sr.join()
    return on_shared_memory(), last, net.weight.detach().clone()


def rank_dies(rank_that_dies=1):
    """One rank SIGKILLs itself before the second allreduce; the other must not hang."""
    sr.allreduce(torch.ones(10), op=sr.Sum)
    if sr.rank() == rank_that_dies:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        sr.allreduce(torch.ones(1_000_000), op=sr.Sum)
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        return type(exc).__name__, str(exc), time.monotonic() - started
    return "no error", "", time.monotonic() - started


def rank_is_late(delay, straight_to_the_ring=False):
    """Rank 1 arrives ``delay`` seconds late at an allreduce (straight to the shared-memory
    ring: past the argument check, which would time out in gloo first)."""
    sr.allreduce(torch.ones(10), op=sr.Sum)
    if sr.rank() == 1:
        time.sleep(delay)
    x = torch.ones(10)
    if straight_to_the_ring:
        state.backend._host_ring.allreduce(x, x, "sum")
    else:
        sr.allreduce(x, op=sr.Sum)
    return on_shared_memory()


def waiting_cpu_share(delay):
    """Rank 0's CPU seconds over wall seconds while it waits at the ring for rank 1, ``delay``
    seconds late."""
    sr.allreduce(torch.ones(10), op=sr.Sum)
    x = torch.ones(10)
    if sr.rank() == 1:
        time.sleep(delay)
    cpu, wall = time.thread_time(), time.perf_counter()
    state.backend._host_ring.allreduce(x, x, "sum")
    return (time.thread_time() - cpu) / (time.perf_counter() - wall), x.tolist() == [2.0] * 10


def async_ops_in_other_orders():
    """Named async allreduces queued in a different order on each rank, then synchronized;
    the results, and how many times the negotiation fell back to gloo's all_gather_object."""
    import torch.distributed as dist

    sr.init()
    calls = []
    real = dist.all_gather_object
    dist.all_gather_object = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    names = ["a", "b", "c"] if sr.rank() == 0 else ["c", "a", "b"]
    tensors = {n: torch.full((5,), float(sr.rank() + i)) for i, n in enumerate(sorted(names))}
    handles = {n: sr.allreduce_async_(tensors[n], op=sr.Sum, name=n) for n in names}
    results = {n: sr.synchronize(h).tolist() for n, h in handles.items()}
    dist.all_gather_object = real
    return results, len(calls)


def bandwidth(nbytes, reps):
    """Seconds per allreduce of ``nbytes`` of float32 (median of ``reps``)."""
    x = torch.ones(nbytes // 4)
    sr.allreduce(x, op=sr.Sum)
    times = []
    for _ in range(reps):
        sr.barrier()
        start = time.perf_counter()
        sr.allreduce(x, op=sr.Sum)
        times.append(time.perf_counter() - start)
    return on_shared_memory(), sorted(times)[len(times) // 2]


def ring_in_use():
    sr.init()
    return on_shared_memory()


class ExpectRing:
    """An estimator callback (rank 0) that fails the fit unless the ring's shared-memory path
    is as expected."""

    def __init__(self, expected):
        self.expected = expected

    def __call__(self, epoch, logs):
        assert on_shared_memory() == self.expected, f"shared memory in use: {on_shared_memory()}"
