"""Rank functions for the Horovod conformance tests (run through tests/helpers/spawn.py)."""
import os
import time

import torch

import sparkring.collective as hvd


def reinit_twice():
    first = hvd.allreduce(torch.ones(3), op=hvd.Sum)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))
    hvd.shutdown()
    hvd.init()
    second = hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), op=hvd.Sum)
    hvd.shutdown()
    hvd.init()
    third = hvd.allgather(torch.tensor([hvd.rank()]))
    del opt
    return {"first": first, "second": second, "third": third}


def trivial():
    return hvd.rank()


DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]


def dtype_probe():
    out = {}
    for dt in DTYPES:
        t = (torch.arange(6) % 2 + hvd.rank()).to(dt)
        for name, fn in [("allreduce", lambda: hvd.allreduce(t, op=hvd.Sum)),
                         ("allreduce_avg", lambda: hvd.allreduce(t)),
                         ("allgather", lambda: hvd.allgather(t)),
                         ("broadcast", lambda: hvd.broadcast(t, 0)),
                         ("alltoall", lambda: hvd.alltoall(t)),
                         ("reducescatter", lambda: hvd.reducescatter(t, op=hvd.Sum))]:
            try:
                fn()
                out[(str(dt), name)] = "ok"
            except Exception as e:
                out[(str(dt), name)] = f"{type(e).__name__}: {str(e)[:80]}"
    return out


def every_dtype_against_a_direct_computation():
    """Each collective, each dtype Horovod supports, against what it must compute."""
    size, me = hvd.size(), hvd.rank()
    out = {}
    for dt in DTYPES:
        base = lambda r: ((torch.arange(6) % 3) + r).to(dt)  # noqa: E731
        mine = base(me)
        everyone = [base(r) for r in range(size)]
        got = {}
        if dt != torch.bool:
            got["sum"] = (hvd.allreduce(mine, op=hvd.Sum), sum(x.double() for x in everyone).to(dt))
            got["min"] = (hvd.allreduce(mine, op=hvd.Min), torch.stack(everyone).min(0).values)
            got["max"] = (hvd.allreduce(mine, op=hvd.Max), torch.stack(everyone).max(0).values)
        got["allgather"] = (hvd.allgather(mine), torch.cat(everyone))
        got["broadcast"] = (hvd.broadcast(mine, root_rank=size - 1), everyone[-1])
        out[str(dt)] = got
    return out


def integer_average_and_scaling():
    """Horovod's integer rules: Average truncates toward zero, scale factors keep the dtype."""
    r = hvd.rank()
    t = torch.tensor([-3, 3, 7, -7], dtype=torch.int32) * (r + 1)  # sums over 2 ranks: -9 9 21 -21
    return {"avg": hvd.allreduce(t, op=hvd.Average),
            "pre": hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5),
            "post": hvd.allreduce(t, op=hvd.Sum, postscale_factor=0.5),
            "int16": hvd.allreduce(t.to(torch.int16), op=hvd.Sum)}


def gradients_through_collectives():
    """Each differentiable collective's gradient, from a loss that weights ranks differently."""
    r, n = hvd.rank(), hvd.size()
    w = float(r + 1)
    out = {}

    x = torch.arange(4, dtype=torch.float64).requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum) * w).sum().backward()
    out["allreduce_sum"] = x.grad.clone()

    x = torch.arange(4, dtype=torch.float64).requires_grad_()
    (hvd.allreduce(x, op=hvd.Average) * w).sum().backward()
    out["allreduce_avg"] = x.grad.clone()

    xs = [torch.ones(2, dtype=torch.float64).requires_grad_(), torch.ones(3, dtype=torch.float64).requires_grad_()]
    a, b = hvd.grouped_allreduce(xs, op=hvd.Sum)
    (a.sum() * w + b.sum() * 2 * w).backward()
    out["grouped"] = [t.grad.clone() for t in xs]
    (a.sum() * w).backward() if a.requires_grad and a.grad_fn is not None else None  # a second backward

    x = torch.ones(r + 1, 2, dtype=torch.float64).requires_grad_()   # rows differ by rank
    g = hvd.allgather(x)
    (g * torch.arange(g.shape[0], dtype=torch.float64).unsqueeze(1) * w).sum().backward()
    out["allgather"] = x.grad.clone()

    x = (torch.ones(3, dtype=torch.float64) * (r + 1)).requires_grad_()
    (hvd.broadcast(x, root_rank=1) * w).sum().backward()
    out["broadcast"] = x.grad.clone()

    x = torch.arange(2 * n, dtype=torch.float64).requires_grad_()
    y = hvd.alltoall(x)
    (y * torch.arange(y.shape[0], dtype=torch.float64) * w).sum().backward()
    out["alltoall"] = x.grad.clone()

    x = torch.ones(2 * n, dtype=torch.float64).requires_grad_()
    (hvd.reducescatter(x, op=hvd.Sum) * w).sum().backward()
    out["reducescatter"] = x.grad.clone()
    return out


def missing_functions_tour():
    r, n = hvd.rank(), hvd.size()
    out = {}
    out["allgather_async"] = hvd.synchronize(hvd.allgather_async(torch.tensor([r] * (r + 1))))
    out["grouped_allgather"] = hvd.grouped_allgather([torch.tensor([r]), torch.full((2, 2), r)])
    out["grouped_allgather_async"] = hvd.synchronize(hvd.grouped_allgather_async([torch.tensor([r])]))
    out["reducescatter_async"] = hvd.synchronize(hvd.reducescatter_async(torch.ones(n * 2) * (r + 1), op=hvd.Sum))
    out["reducescatter_scaled"] = hvd.reducescatter(torch.ones(n * 2) * (r + 1), op=hvd.Sum, prescale_factor=2.0,
                                                    postscale_factor=0.5)
    out["grouped_reducescatter"] = hvd.grouped_reducescatter([torch.ones(n), torch.ones(n, 2)], op=hvd.Sum)
    out["grouped_reducescatter_async"] = hvd.synchronize(
        hvd.grouped_reducescatter_async([torch.ones(n) * r], op=hvd.Average))
    output, received = hvd.synchronize(hvd.alltoall_async(torch.arange(n) + 10 * r, splits=[1] * n))
    out["alltoall_async"] = (output, received)
    sparse = torch.sparse_coo_tensor(torch.tensor([[r, 5]]), torch.tensor([1.0, 2.0]), (8,))
    out["sparse"] = hvd.synchronize(hvd.sparse_allreduce_async(sparse, "emb", hvd.Sum)).to_dense()
    out["sparse_avg"] = hvd.synchronize(hvd.sparse_allreduce_async(sparse, "emb2", hvd.Average)).to_dense()
    out["flags"] = (hvd.gloo_enabled(), hvd.mpi_enabled(), hvd.nccl_enabled(), hvd.ccl_built(), hvd.ddl_built())
    return out


def mismatched(case):
    """Rank-dependent arguments that Horovod refuses; every rank must raise (never abort or hang)."""
    r = hvd.rank()
    if case == "shape":
        return hvd.allreduce(torch.ones(2 + r))
    if case == "dtype":
        return hvd.allreduce(torch.ones(2, dtype=torch.float32 if r == 0 else torch.float64))
    if case == "op":
        return hvd.allreduce(torch.ones(2), op=hvd.Sum if r == 0 else hvd.Max)
    if case == "root":
        return hvd.broadcast(torch.ones(2), root_rank=r)
    if case == "name":
        return hvd.allreduce(torch.ones(2), name=f"grad.{r}")
    if case == "allgather_tail":
        return hvd.allgather(torch.ones(1, 2 + r))
    if case == "kind":
        return hvd.allreduce(torch.ones(2)) if r == 0 else hvd.allgather(torch.ones(2))
    if case == "in_flight_name":
        hvd.allreduce_async(torch.ones(1), name="x")
        return hvd.allreduce_async(torch.ones(1), name="x")
    raise ValueError(case)


def optimizer_details():
    import warnings

    r = hvd.rank()
    out = {}
    # a fresh Adam has no state yet: it gets root's after broadcast_optimizer_state
    torch.manual_seed(r)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    if r == 0:  # root trains one step; rank 1 stays fresh
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["adam_step"] = [opt.state[p]["step"].item() for p in model.parameters()]
    out["adam_exp_avg"] = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    # without named_parameters: Horovod's names
    dist_opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    out["names"] = sorted(dist_opt._sr_names.values())
    # step() after synchronize() without skip_synchronize() warns, as Horovod
    model(torch.ones(2, 3)).sum().backward()
    dist_opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist_opt.step()
    out["warned"] = any("skip_synchronize" in str(w.message) for w in caught)
    return out


def sparse_embedding_training(sparse_as_dense):
    """nn.Embedding(sparse=True) through DistributedOptimizer: grads travel as indices+values."""
    r = hvd.rank()
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 4, sparse=True)
    head = torch.nn.Linear(4, 1)
    params = list(emb.parameters()) + list(head.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.5),
                                   named_parameters=list(emb.named_parameters(prefix="emb"))
                                   + list(head.named_parameters(prefix="head")),
                                   sparse_as_dense=sparse_as_dense)
    kinds = []
    for step in range(3):
        ids = torch.tensor([(step * 7 + r * 3 + k) % 50 for k in range(4)])
        opt.zero_grad()
        head(emb(ids)).pow(2).mean().backward()
        kinds.append(emb.weight.grad.is_sparse)
        opt.step()
    return {"emb": emb.weight.detach().clone(), "head": head.weight.detach().clone(), "sparse_grads": kinds}


def sparse_embedding_reference(size):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 4)
    head = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.5)
    for step in range(3):
        opt.zero_grad()
        losses = []
        for r in range(size):
            ids = torch.tensor([(step * 7 + r * 3 + k) % 50 for k in range(4)])
            losses.append(head(emb(ids)).pow(2).mean())
        (sum(losses) / size).backward()
        opt.step()
    return {"emb": emb.weight.detach().clone(), "head": head.weight.detach().clone()}


def process_sets_tour():
    """3 ranks: a set of ranks 0 and 2; rank 1 is outside and must not be blocked by it."""
    r = hvd.rank()
    out = {}
    evens = hvd.add_process_set([0, 2])
    odd_alone = hvd.add_process_set(hvd.ProcessSet([1]))
    out["ids"] = (evens.process_set_id, odd_alone.process_set_id)
    out["included"] = (evens.included(), odd_alone.included())
    try:
        hvd.add_process_set([0, 2])
    except ValueError as exc:
        out["duplicate"] = str(exc)
    if evens.included():
        out["set_rank"], out["set_size"] = evens.rank(), evens.size()
        out["sum"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=evens)
        out["gather"] = hvd.allgather(torch.tensor([r]), process_set=evens)
        out["bcast"] = hvd.broadcast(torch.tensor([r * 10]), root_rank=2, process_set=evens)
        out["alltoall"] = hvd.alltoall(torch.tensor([r, r]), process_set=evens)
        out["rs"] = hvd.reducescatter(torch.ones(2) * r, op=hvd.Sum, process_set=evens)
        out["obj"] = hvd.allgather_object(r, process_set=evens)
        x = torch.ones(2, requires_grad=True)
        (hvd.allreduce(x, op=hvd.Sum, process_set=evens) * (r + 1)).sum().backward()
        out["grad"] = x.grad.clone()
        # DistributedOptimizer over the set: one process on the members' batches
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), process_set=evens)
        for step in range(2):
            opt.zero_grad()
            model(torch.full((4, 3), float(r + step))).pow(2).mean().backward()
            opt.step()
        out["weights"] = model.weight.detach().clone()
    else:
        out["alone"] = hvd.allreduce(torch.tensor([5.0]), op=hvd.Sum, process_set=odd_alone)
        try:
            hvd.allreduce(torch.ones(1), process_set=evens)
        except ValueError as exc:
            out["outsider"] = str(exc)
    hvd.barrier()
    out["removed"] = hvd.remove_process_set(evens)
    out["removed_again"] = hvd.remove_process_set(evens)
    try:
        hvd.allreduce(torch.ones(1), process_set=evens)
    except ValueError as exc:
        out["after_remove"] = str(exc)
    out["global_sum"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=hvd.global_process_set)
    return out


def peer_loss():
    """Rank 1 leaves the ring abruptly; rank 0's next collective raises HorovodInternalError."""
    import threading

    hvd.allreduce(torch.ones(4))
    if hvd.rank() == 1:
        threading.Timer(1.0, os._exit, args=(0,)).start()  # after its answer reached the test
        return "left"
    time.sleep(2.0)
    try:
        hvd.allreduce(torch.ones(1 << 16), name="after_the_loss")
    except hvd.HorovodInternalError as exc:
        started = time.monotonic()
        hvd.shutdown()  # what elastic code does next
        return {"type": type(exc).__name__, "runtime": isinstance(exc, RuntimeError), "message": str(exc),
                "cause": type(exc.__cause__).__name__, "shutdown_s": time.monotonic() - started}
    return "no error"


def async_ops_in_any_order():
    """Horovod's coordinator semantics: an async op runs once every rank started it, whatever
    else each rank did in between; poll() is False until then; a name in flight twice raises."""
    r = hvd.rank()
    out = {}
    t = torch.full((3,), float(r + 1))
    if r == 0:  # Horovod's duplicate-name test: rank 0 starts its op before a barrier, rank 1 after
        first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        out["polled_before"] = hvd.poll(first)
        out["second"] = _raises(lambda: hvd.allreduce_async(t, name="dup"))
    hvd.barrier()
    if r > 0:
        first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        out["polled_before"] = hvd.poll(first)
        out["second"] = _raises(lambda: hvd.allreduce_async(t, name="dup"))
    hvd.barrier()
    out["dup"] = hvd.synchronize(first)
    # the same two named ops started in opposite orders, then one unnamed op of each kind
    a, b = torch.tensor([1.0 + r]), torch.tensor([10.0 * (r + 1)])
    names = ["a", "b"] if r == 0 else ["b", "a"]
    handles = {n: hvd.allreduce_async(a if n == "a" else b, name=n, op=hvd.Sum) for n in names}
    out["b"] = hvd.synchronize(handles["b"])
    out["a"] = hvd.synchronize(handles["a"])
    kinds = [hvd.allgather_async(torch.tensor([r])), hvd.broadcast_async(torch.tensor([r + 5]), 1),
             hvd.reducescatter_async(torch.ones(4) * (r + 1), op=hvd.Sum),
             hvd.alltoall_async(torch.arange(hvd.size()) + 10 * r)]
    out["polled"] = [hvd.poll(h) for h in kinds]
    out["kinds"] = [hvd.synchronize(h) for h in kinds]
    out["after"] = [hvd.poll(h) for h in kinds]
    return out


def _raises(call):
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


def ring_usable_after_errors():
    """After a mismatch, a wait for an op no other rank started, and refused arguments, every
    rank is at the same point: ten good collectives of different kinds follow."""
    r = hvd.rank()
    out = {"errors": []}
    for bad in (lambda: hvd.allreduce(torch.ones(2 + r)),
                lambda: hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="only-on-0")) if r == 0
                else hvd.barrier(),
                lambda: hvd.reducescatter(torch.tensor(float(r))),
                lambda: hvd.reducescatter(torch.ones(4), op=hvd.Adasum),
                # uninitialized float splits (Horovod's test) differ by rank: refused before any transfer
                lambda: hvd.alltoall(torch.empty(hvd.size()), torch.empty(hvd.size()).uniform_(0, 2 * r + 1))):
        try:
            bad()
            out["errors"].append(None)
        except (RuntimeError, ValueError) as exc:
            out["errors"].append((type(exc).__name__, isinstance(exc, RuntimeError), str(exc)))
    good = []
    for i in range(10):
        kind = i % 5
        if kind == 0:
            good.append(hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).item())
        elif kind == 1:
            good.append(hvd.allgather(torch.tensor([r])).tolist())
        elif kind == 2:
            good.append(hvd.broadcast(torch.tensor([r + i]), root_rank=0).item())
        elif kind == 3:
            good.append(hvd.allgather_object(("obj", r)))
        else:
            hvd.barrier()
            good.append("barrier")
    out["good"] = good
    return out


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


def resume_broadcast_of_optimizer_state(wrapped):
    """Horovod's resume pattern: only rank 0 has optimizer state (it loaded a checkpoint); after
    broadcast_parameters + broadcast_optimizer_state every rank holds rank 0's, for any optimizer."""
    r = hvd.rank()
    out = {}
    for name, make in OPTIMIZERS.items():
        torch.manual_seed(r)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
        opt = make(model.parameters())
        if wrapped:
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        if r == 0:  # rank 0 loads a checkpoint: weights and optimizer state of two trained steps
            source = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
            trained = make(source.parameters())
            for _ in range(2):
                trained.zero_grad()
                source(torch.ones(5, 4)).pow(2).sum().backward()
                trained.step()
            model.load_state_dict(source.state_dict())
            opt.load_state_dict(trained.state_dict())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        state = opt.state_dict()
        out[name] = {"params": [v.clone() for _, v in sorted(model.state_dict().items())],
                     "state": {pid: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
                               for pid, s in state["state"].items()},
                     "groups": [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]}
        # and it trains on from there, identically on every rank
        opt.zero_grad()
        model(torch.ones(5, 4)).pow(2).sum().backward()
        opt.step()
        out[name]["after_step"] = [v.clone() for _, v in sorted(model.state_dict().items())]
    return out


def optimizers_horovod_style():
    """DistributedOptimizer without named_parameters (Horovod's _parameter_names), SparseAdam with
    sparse embeddings (sparse_as_dense or not), an optimizer on a process set this rank is not in,
    and barrier(process_set) positional."""
    r = hvd.rank()
    out = {}
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([{"params": model[0].parameters()},
                                                    {"params": model[1].parameters()}], lr=0.001))
    out["names"] = sorted(opt._parameter_names.values())
    out["all_names"] = hvd.allgather_object(set(opt._parameter_names.values()))
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        sparse_opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                              sparse_as_dense=sparse_as_dense)
        ids = torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]] if r == 0 else [[1, 3, 4], [4, 7, 9]])
        sparse_opt.zero_grad()
        emb(ids).sum().backward()
        sparse_opt.step()
        out[f"sparse_adam_{sparse_as_dense}"] = emb.weight.detach().clone()
    evens = hvd.add_process_set([k for k in range(hvd.size()) if k % 2 == 0])
    odds = hvd.add_process_set([k for k in range(hvd.size()) if k % 2 == 1])
    torch.manual_seed(r)
    net = torch.nn.Linear(3, 2)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    set_opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5),
                                       named_parameters=net.named_parameters(), process_set=evens)
    net(torch.ones(2, 3) * (r + 1)).sum().backward()
    set_opt.step()
    mine = evens if r % 2 == 0 else odds
    out["set_weights"] = hvd.allgather(net.weight.detach().reshape(1, -1), process_set=mine)
    started = time.monotonic()
    if r == 0:
        time.sleep(1.0)
    hvd.barrier(mine)  # positional, as Horovod's test calls it
    out["barrier_s"] = time.monotonic() - started
    hvd.remove_process_set(odds)
    hvd.remove_process_set(evens)
    return out


def reinit_seconds(times):
    """Seconds each shutdown() + init() + first collective takes (gloo mode does it per test)."""
    out = []
    for _ in range(times):
        started = time.monotonic()
        hvd.shutdown()
        hvd.init()
        hvd.allreduce(torch.ones(1))
        out.append(time.monotonic() - started)
    return out


def outcome(fn_name, **kwargs):
    """("ok", result) or ("error", traceback) of one function here: every rank's outcome reaches
    the test, also where a rank raising would end the run (sparkring.run on MPI)."""
    import traceback

    try:
        return "ok", globals()[fn_name](**kwargs)
    except Exception:  # noqa: BLE001 - the test reads it
        return "error", traceback.format_exc()
