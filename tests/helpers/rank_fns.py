"""Functions run on ranks by the tests (importable by Spark's workers by reference)."""
import os
import time

import torch

import sparkring.collective as sr


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def make_batches(steps=4, batch=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 5, generator=g), torch.randn(batch, 3, generator=g)) for _ in range(steps)]


def train_reference(compression=None, bpps=1, steps=4, set_to_none=True):
    """One process on the whole batches."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = make_batches(steps * bpps)
    for i in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        for x, y in batches[i * bpps:(i + 1) * bpps]:
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def train_distributed(compression="none", bpps=1, steps=4, bucket_bytes=None, set_to_none=True,
                      report_grad_storage=False, scheduler_first=False):
    """Each rank trains on its half of every batch (scheduler_first: an LR scheduler made over
    the optimizer before the wrap, as Lightning's configure_optimizers makes it)."""
    model = make_model(seed=0 if sr.rank() == 0 else 100 + sr.rank())  # broadcast must fix rank 1
    sr.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000) if scheduler_first else None
    kwargs = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    opt = sr.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression=getattr(sr.Compression, compression),
                                  backward_passes_per_step=bpps, **kwargs)
    batches = make_batches(steps * bpps)
    half = 8 // sr.size()
    lo, hi = sr.rank() * half, (sr.rank() + 1) * half
    for i in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        for x, y in batches[i * bpps:(i + 1) * bpps]:
            torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
        if sched is not None:
            sched.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if report_grad_storage:  # do the gradients live in the optimizer's reduction buffers?
        buffers = {b.buffer.untyped_storage().data_ptr() for b in opt._sr_buckets}
        state["grads_in_buffers"] = all(p.grad.untyped_storage().data_ptr() in buffers
                                        for p in model.parameters())
    return state


def collectives_tour():
    r, n = sr.rank(), sr.size()
    out = {"rank": r, "size": n, "local_rank": sr.local_rank(), "local_size": sr.local_size(),
           "backend": sr.backend()}
    odd = torch.arange(7, dtype=torch.float32) + r
    out["avg_odd"] = sr.allreduce(odd)
    out["sum_odd"] = sr.allreduce(odd, op=sr.Sum)
    out["min"] = sr.allreduce(odd, op=sr.Min)
    out["max"] = sr.allreduce(odd, op=sr.Max)
    out["odd_untouched"] = odd.clone()
    out["empty"] = sr.allreduce(torch.empty(0))
    out["int_sum"] = sr.allreduce(torch.tensor([1, 2, 3], dtype=torch.int32) * (r + 1), op=sr.Sum)
    out["f64"] = sr.allreduce(torch.tensor([0.1, 0.2], dtype=torch.float64) * (r + 1), op=sr.Sum)
    inplace = torch.ones(3) * (r + 1)
    sr.allreduce_(inplace, op=sr.Sum)
    out["inplace"] = inplace
    h = sr.allreduce_async(torch.ones(5) * r, op=sr.Sum)
    out["async"] = sr.synchronize(h)
    out["gather"] = sr.allgather(torch.full((r + 1, 2), float(r)))
    out["bcast"] = sr.broadcast(torch.tensor([r + 10]), root_rank=1)
    out["bobj"] = sr.broadcast_object({"from": r}, root_rank=0)
    out["gobj"] = sr.allgather_object(("rank", r))
    sr.barrier()
    return out


def optimizer_state_tour():
    model = make_model(seed=sr.rank())
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (sr.rank() + 1))
    x = torch.randn(4, 5) * (sr.rank() + 1)
    model(x).sum().backward()
    opt.step()
    sr.broadcast_parameters(model.named_parameters(), root_rank=0)
    sr.broadcast_optimizer_state(opt, root_rank=0)
    st = opt.state_dict()
    first = st["state"][0]
    return {"lr": st["param_groups"][0]["lr"], "step": float(first["step"]),
            "exp_avg": first["exp_avg"].clone(), "weight": model[0].weight.detach().clone()}


def two_optimizers():
    """Two optimizers over disjoint halves of one model, names prefixed per optimizer."""
    model = make_model()
    first, second = model[0], model[2]
    opt1 = sr.DistributedOptimizer(torch.optim.SGD(first.parameters(), lr=0.1),
                                   named_parameters=[("a." + n, p) for n, p in first.named_parameters()])
    opt2 = sr.DistributedOptimizer(torch.optim.SGD(second.parameters(), lr=0.1),
                                   named_parameters=[("b." + n, p) for n, p in second.named_parameters()])
    x, y = make_batches(1)[0]
    torch.nn.functional.mse_loss(model(x[sr.rank() * 4:(sr.rank() + 1) * 4]),
                                 y[sr.rank() * 4:(sr.rank() + 1) * 4]).backward()
    opt1.step()
    opt2.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def clip_then_step():
    model = make_model()
    opt = sr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    x, y = make_batches(1)[0]
    torch.nn.functional.mse_loss(model(x[sr.rank() * 4:(sr.rank() + 1) * 4]),
                                 y[sr.rank() * 4:(sr.rank() + 1) * 4]).backward()
    opt.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    return grads


def whoami():
    return {"rank": sr.rank(), "size": sr.size(), "local_rank": sr.local_rank(),
            "local_size": sr.local_size(), "pid": os.getpid(),
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "backend": sr.backend(),
            "omp": os.environ.get("OMP_NUM_THREADS"), "gpu": os.environ.get("SPARKRING_GPU"),
            "sum": sr.allreduce(torch.tensor([float(sr.rank())]), op=sr.Sum).item()}


def big_result(mb):
    g = torch.Generator().manual_seed(sr.rank())
    return {"w": torch.randn(mb * 1024 * 1024 // 4, generator=g)}


def fail_on_rank(bad_rank):
    if sr.rank() == bad_rank:
        time.sleep(0.5)
        raise ValueError(f"boom on purpose in rank {bad_rank}")
    # The healthy rank blocks in a collective the failed rank never joins.
    sr.allreduce(torch.ones(1))
    time.sleep(120)
    return "should not get here"


def hang_on_rank(bad_rank):
    if sr.rank() == bad_rank:
        time.sleep(600)
    sr.barrier()
    return "done"


def print_and_wait(flag_path, wait_s=30):
    print(f"rank {sr.rank()} says hello", flush=True)
    if sr.rank() == 0:
        print("waiting-for-driver", flush=True)
        deadline = time.time() + wait_s
        while time.time() < deadline:
            if os.path.exists(flag_path):
                return True
            time.sleep(0.1)
        return False
    return True


def report_events(n):
    from sparkring.runner import report

    for i in range(n):
        report({"i": i, "rank": sr.rank()})
    sr.barrier()
    return n


def large_out_of_place_allreduce():
    """Tensors big enough for the direct out-of-place algorithms (two-rank swap up to 8 MB,
    ring above it or with more ranks), of sizes no rank count divides."""
    from sparkring.collective import _runtime

    r = sr.rank()
    b = _runtime.current()
    g = torch.Generator().manual_seed(r)
    x = torch.randn(600_007, generator=g, dtype=torch.float64)
    z = torch.randn(1_100_003, generator=g, dtype=torch.float64)
    out = {"x": x.clone(), "direct": b.out_of_place_applies(x) and b.out_of_place_applies(z),
           "algorithms": {b.out_of_place_algorithm(x), b.out_of_place_algorithm(z)}}
    out["z"], out["z_max"] = z, sr.allreduce(z, op=sr.Max)
    for op in ("Sum", "Average", "Min", "Max", "Product"):
        out[op] = sr.allreduce(x, op=getattr(sr, op))
    out["untouched"] = torch.equal(x, out["x"])
    xi = torch.randint(-1000, 1000, (600_007,), generator=g, dtype=torch.int32)
    out["xi"], out["int_sum"] = xi, sr.allreduce(xi, op=sr.Sum)
    y = torch.randn(3, 180_001, generator=g)
    out["y"], out["y_avg"] = y, sr.allreduce(y)
    in_place = y.clone()  # the same tensor object comes back, reduced
    out["in_place_is_same_tensor"] = sr.allreduce_(in_place, op=sr.Max) is in_place
    out["y_max_in_place"] = in_place
    # a result the caller still holds is never handed out again
    first = sr.allreduce(y, op=sr.Sum)
    kept = first.clone()
    del out["y_avg"]
    out["y_avg"] = sr.allreduce(y)
    out["second"] = sr.allreduce(y * 2, op=sr.Sum)
    out["first_intact"] = torch.equal(first, kept)
    return out


def dtype_and_collective_tour():
    """Every dtype torch reduces and the Horovod collectives beyond the basic tour."""
    r, n = sr.rank(), sr.size()
    out = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8):
        out[f"sum_{dtype}"] = sr.allreduce(torch.arange(5).to(dtype) + r, op=sr.Sum)
    out["avg_half"] = sr.allreduce(torch.tensor([1.0, 3.0], dtype=torch.float16) * (r + 1))
    out["prod"] = sr.allreduce(torch.tensor([2.0, 3.0]) + r, op=sr.Product)
    out["bool_max"] = sr.allreduce(torch.tensor([r == 0, False, True]), op=sr.Max)
    out["complex"] = sr.allreduce(torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (r + 1), op=sr.Sum)
    out["strided"] = sr.allreduce(torch.arange(12.0).reshape(3, 4).t() + r, op=sr.Sum)
    big = torch.full((700_001,), float(r + 1))
    out["big"] = sr.allreduce(big, op=sr.Sum)[[0, -1]]
    out["grouped"] = sr.grouped_allreduce([torch.ones(2) * r, torch.ones(3, dtype=torch.float64) * r], op=sr.Sum)
    out["alltoall"] = sr.alltoall(torch.arange(3 * n) + 100 * r)
    out["reducescatter"] = sr.reducescatter(torch.arange(4.0 * n) * (r + 1), op=sr.Sum)
    params = {"w": torch.full((3,), float(r)), "step": torch.tensor(r)}
    sr.broadcast_parameters(params, root_rank=1)
    out["params"] = params
    out["bcast_bf16"] = sr.broadcast(torch.tensor([1.5, 2.5], dtype=torch.bfloat16) * (r + 1), root_rank=0)
    return out


def listening_addresses():
    """Addresses this rank's process and its parent (task process or mpiexec) listen on."""
    import psutil

    me = psutil.Process()
    sr.barrier()  # every rank's transport is up before anyone looks
    procs = [me] + [me.parent()] if me.parent() is not None else [me]
    addrs = sorted({c.laddr.ip for p in procs for c in p.net_connections(kind="inet") if c.status == "LISTEN"})
    sr.barrier()
    return {"addrs": addrs, "launcher": me.parent().name()}


def sleep_on_rank(bad_rank):
    """The bad rank sleeps past any test timeout; the others finish at once (no collective)."""
    if sr.rank() == bad_rank:
        time.sleep(600)
    return "done"


def rank_one_finishes_later(delay):
    """Rank 0 returns at once, rank 1 only after ``delay`` seconds (no collective between)."""
    if sr.rank() == 1:
        time.sleep(delay)
    return sr.rank()


def secret_visibility():
    """Whether the run's secret is in this rank's environment or a child's; then report an event."""
    import subprocess
    import sys

    from sparkring.runner import report

    child = subprocess.run([sys.executable, "-c", "import os; print('SPARKRING_SECRET' in os.environ)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    reported = report({"rank": sr.rank()})
    return {"in_rank": "SPARKRING_SECRET" in os.environ, "in_child": child == "True", "reported": reported}


def killed_on_rank(bad_rank):
    """``bad_rank`` dies of SIGKILL (as from the OOM killer); the others wait in a collective."""
    import signal

    if sr.rank() == bad_rank:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    sr.allreduce(torch.ones(1))
    time.sleep(120)


def lose_executor_of_rank0(marker):
    """Rank 0 kills its executor's JVM once (a lost node); the run then needs the slot back."""
    import signal

    import psutil

    if sr.rank() == 0 and not os.path.exists(marker):
        open(marker, "w").close()
        for parent in psutil.Process().parents():
            if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in parent.cmdline():
                parent.send_signal(signal.SIGKILL)
        time.sleep(60)
    sr.barrier()
    return sr.rank()


def gpu_view():
    """What a rank that was given GPUs sees: its CUDA_VISIBLE_DEVICES, its GPU ordinal, and
    whether it was spawned (a fresh interpreter runs the worker module) or forked."""
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode()
    return {"rank": sr.rank(), "local_rank": sr.local_rank(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpu": os.environ.get("SPARKRING_GPU"), "backend": sr.backend(),
            "spawned": "sparkring.runner.task.worker" in cmdline}


def grad_scaler_skips_alike():
    """DistributedOptimizer with a GradScaler, the way fit(precision="16-mixed") steps: the scaler
    unscales the *reduced* gradients, so an overflow on one rank skips the step on every rank."""
    import torch

    import sparkring.collective as sr
    from sparkring.trainer.placement import scaled_update

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = sr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    skipped = []
    for step in range(3):
        opt.zero_grad()
        x = torch.ones(2, 4) * (1e38 if step == 1 and sr.rank() == 1 else 1.0)  # its gradient: inf
        scaler.scale(model(x).sum()).backward()
        skipped.append(bool(scaled_update(opt, scaler)))  # the trainer's own 16-mixed update
    return [v.tolist() for v in model.state_dict().values()], scaler.get_scale(), skipped


def bf16_compressed_training():
    """The same two steps with float32 and with bfloat16 gradients on the wire: rank 0's weights."""
    import torch

    import sparkring.collective as sr

    out = []
    for compression in (sr.Compression.none, sr.Compression.bf16):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 4)
        opt = sr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                      named_parameters=model.named_parameters(), compression=compression)
        torch.manual_seed(1 + sr.rank())
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
        out.append(model.weight.detach().clone())
    sr.allreduce(torch.ones(8), name="final.loss")  # Horovod's phases of a named collective on the timeline
    return out


def busy_without_a_word(seconds):
    """Hold the rank's interpreter (a pure-Python loop, the GIL never free) for ``seconds``, printing nothing."""
    deadline, spins = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        spins += 1
    sr.barrier()
    return spins > 0


def tell_my_task_then_wait_in_allreduce(path, rank_to_tell):
    """Rank ``rank_to_tell`` writes its task's pid to ``path``; every rank then waits in collectives."""
    if sr.rank() == rank_to_tell:
        with open(path + ".tmp", "w") as f:
            f.write(os.environ["SPARKRING_PARENT_PID"])
        os.replace(path + ".tmp", path)
    for _ in range(600):
        sr.allreduce(torch.ones(1))
        time.sleep(0.1)
    return "should not get here"


def measured_link_then_report(nbytes):
    """This rank's link to the driver (runner.measure_link), then an event on the same channel."""
    from sparkring.runner import measure_link, report

    rate = measure_link(nbytes)
    return {"rate": rate, "reported": report({"after_probe": True})}
