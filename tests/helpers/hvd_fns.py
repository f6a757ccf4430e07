"""Horovod-style code for the drop-in tests, written against `hvd` exactly as for horovod.torch."""

import torch
import torch.nn.functional as F

import sparkring.collective as hvd


class Metric(object):
    """Horovod's ImageNet example metric: running average, allreduced by name."""

    def __init__(self, name):
        self.name = name
        self.sum = torch.tensor(0.)
        self.n = torch.tensor(0.)

    def update(self, val):
        self.sum += hvd.allreduce(val.detach().cpu(), name=self.name)
        self.n += 1

    @property
    def avg(self):
        return self.sum / self.n


def imagenet_in_miniature(use_adasum=False, epochs=3, resume_epoch_on_rank0=1):
    torch.manual_seed(0)
    base_lr, warmup_epochs, batches_per_allreduce = 0.05, 1, 2
    g = torch.Generator().manual_seed(5)
    w_true = torch.randn(20, 4, generator=g)
    x_all = torch.randn(512, 20, generator=g)
    y_all = (x_all @ w_true).argmax(dim=1)
    # shard like DistributedSampler
    x, y = x_all[hvd.rank()::hvd.size()], y_all[hvd.rank()::hvd.size()]
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    # Horovod: resume_from_epoch is decided on rank 0 and broadcast
    resume_from_epoch = resume_epoch_on_rank0 if hvd.rank() == 0 else 0
    resume_from_epoch = hvd.broadcast(torch.tensor(resume_from_epoch), root_rank=0,
                                      name="resume_from_epoch").item()
    lr_scaler = batches_per_allreduce * hvd.size() if not use_adasum else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr * lr_scaler, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16,
                                         backward_passes_per_step=batches_per_allreduce,
                                         op=hvd.Adasum if use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def adjust_learning_rate(epoch, batch_idx, steps):
        if epoch < warmup_epochs:
            epoch += float(batch_idx + 1) / steps
            lr_adj = 1. / hvd.size() * (epoch * (hvd.size() - 1) / warmup_epochs + 1)
        else:
            lr_adj = 1.
        for param_group in optimizer.param_groups:
            param_group["lr"] = base_lr * hvd.size() * batches_per_allreduce * lr_adj

    losses = []
    bs = 16
    steps = len(x) // (bs * batches_per_allreduce)
    for epoch in range(resume_from_epoch, resume_from_epoch + epochs):
        train_loss = Metric("train_loss")
        for batch_idx in range(steps):
            if not use_adasum:
                adjust_learning_rate(epoch, batch_idx, steps)
            optimizer.zero_grad()
            for i in range(batches_per_allreduce):
                s = (batch_idx * batches_per_allreduce + i) * bs
                loss = F.cross_entropy(model(x[s:s + bs]), y[s:s + bs])
                train_loss.update(loss)
                (loss / batches_per_allreduce).backward()
            optimizer.step()
        losses.append(train_loss.avg.item())
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"losses": losses, "resume": resume_from_epoch, "weights": weights,
            "lr": optimizer.param_groups[0]["lr"]}


def horovod_surface():
    out = {}
    r = hvd.rank()
    out["flags"] = (hvd.is_initialized(), hvd.gloo_built(), hvd.mpi_built(), hvd.mpi_threads_supported(),
                    hvd.cross_rank(), hvd.cross_size())
    t = torch.tensor([1.0, 2.0]) * (r + 1)
    out["avg_kw"] = hvd.allreduce(t, average=True).tolist()
    out["sum_kw"] = hvd.allreduce(t, average=False).tolist()
    out["scaled"] = hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).tolist()
    out["product"] = hvd.allreduce(t, op=hvd.Product).tolist()
    h = hvd.allreduce_async_(t.clone(), op=hvd.Sum)
    out["poll_then_sync"] = hvd.synchronize(h).tolist()
    out["grouped"] = [x.tolist() for x in hvd.grouped_allreduce([t, torch.ones(3) * r], op=hvd.Sum)]
    out["alltoall"] = hvd.alltoall(torch.arange(4) + 10 * r).tolist()
    output, received = hvd.alltoall(torch.arange(3) + 10 * r, splits=[1, 2] if r == 0 else [2, 1])
    out["alltoall_splits"] = output.tolist()
    out["alltoall_received"] = received.tolist()
    out["reducescatter"] = hvd.reducescatter(torch.ones(5, 2) * (r + 1), op=hvd.Sum).tolist()
    b = torch.tensor([r + 5])
    hvd.broadcast_(b, root_rank=1)
    out["broadcast_"] = b.tolist()
    out["bcast_async"] = hvd.synchronize(hvd.broadcast_async(torch.tensor([r]), root_rank=0)).tolist()
    try:
        hvd.allreduce(torch.ones(2 + r), name="mismatch")
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


def sync_batch_norm_grads(seed=0):
    torch.manual_seed(seed)
    x = torch.randn(8, 3, 4)
    bn = hvd.SyncBatchNorm(3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
    half = x[hvd.rank() * 4:(hvd.rank() + 1) * 4].clone().requires_grad_(True)
    out = bn(half)
    (out * torch.arange(4 * 3 * 4).reshape(4, 3, 4).float()).sum().backward()
    return {"out": out.detach(), "dx": half.grad, "dw": hvd.allreduce(bn.weight.grad, op=hvd.Sum),
            "running_mean": bn.running_mean.clone(), "running_var": bn.running_var.clone()}


def adasum_of_rank_vectors(seed=0):
    g = torch.Generator().manual_seed(seed + hvd.rank())
    v = torch.randn(11, dtype=torch.float64, generator=g)
    return {"mine": v, "adasum": hvd.allreduce(v, op=hvd.Adasum)}


def join_with_uneven_steps(steps_by_rank=(2, 4, 6)):
    """Every reduce op while ranks drop out, then a second round with gathers and broadcasts."""
    r = hvd.rank()
    out = {k: [] for k in ("sum", "avg", "min", "max", "prod", "big")}
    for _ in range(steps_by_rank[r]):
        v = torch.tensor([float(r + 1)] * 3)
        handle = hvd.allreduce_async(v, name="avg")  # in flight while the others run
        out["sum"].append(hvd.allreduce(v, op=hvd.Sum, name="sum")[0].item())
        out["min"].append(hvd.allreduce(v, op=hvd.Min)[0].item())
        out["max"].append(hvd.allreduce(v.long(), op=hvd.Max)[0].item())
        out["prod"].append(hvd.allreduce(v, op=hvd.Product, compression=hvd.Compression.fp16)[0].item())
        out["avg"].append(hvd.synchronize(handle)[0].item())
        big = hvd.allreduce(torch.full((600_001,), float(r + 1)), op=hvd.Sum)  # the ring path
        out["big"].append((big[0].item(), big[-1].item()))
    out["last"] = hvd.join()
    if r == 0:  # round 2: rank 0 has nothing more to do
        out["last2"] = hvd.join()
        return out
    out["sum2"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).item()
    hvd.barrier()
    out["last2"] = hvd.join()
    return out


def collective_while_rank_zero_joined(kind):
    """Rank 0 joins; rank 1 calls ``kind``, which Horovod refuses there (rank 0 goes on serving),
    then joins too; then both run an allreduce together."""
    if hvd.rank() == 0:
        last = hvd.join()
        return {"last": last, "after": hvd.allreduce(torch.ones(1), op=hvd.Sum).item()}
    call = {"allgather": lambda: hvd.allgather(torch.ones(2)),
            "broadcast": lambda: hvd.broadcast(torch.ones(2), root_rank=1),
            "alltoall": lambda: hvd.alltoall(torch.ones(2)),
            "reducescatter": lambda: hvd.reducescatter(torch.ones(2)),
            "allgather_object": lambda: hvd.allgather_object(1),
            "broadcast_object": lambda: hvd.broadcast_object(1, root_rank=1)}[kind]
    try:
        call()
        error = None
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {exc}"
    last = hvd.join()
    return {"error": error, "last": last, "after": hvd.allreduce(torch.ones(1), op=hvd.Sum).item()}


def uneven_training(batches=(2, 4), lr=0.1):
    """DistributedOptimizer on shards of different lengths: the short rank joins."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters())
    for x, y in uneven_batches(batches)[hvd.rank()]:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    last = hvd.join()
    return {"last": last, "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def uneven_batches(batches):
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(k)]
            for k in batches]


def broadcast_from_a_joined_rank():
    if hvd.rank() == 0:
        hvd.join()
    else:
        hvd.broadcast(torch.ones(2), root_rank=0, name="weights")


def join_with_two_rank_swaps(steps_by_rank=(1, 3)):
    """Two ranks: 2 MB tensors (out of place: the swap; in place: gloo's allreduce) while the
    short rank has joined and replays them."""
    r = hvd.rank()
    out = {"new": [], "in_place": []}
    for _ in range(steps_by_rank[r]):
        out["new"].append(hvd.allreduce(torch.full((500_001,), float(r + 1)), op=hvd.Sum)[[0, -1]].tolist())
        t = torch.full((500_001,), float(r + 1))
        hvd.allreduce_(t, op=hvd.Max)
        out["in_place"].append(t[[0, -1]].tolist())
    out["last"] = hvd.join()
    return out


def process_sets_pair():
    """2 ranks: one singleton process set per rank; collectives within each, an outsider
    refused, then removal and a global collective again."""
    r = hvd.rank()
    sets = [hvd.add_process_set([0]), hvd.add_process_set([1])]
    mine, other = sets[r], sets[1 - r]
    out = {"ids": [ps.process_set_id for ps in sets], "set": (mine.rank(), mine.size())}
    out["sum"] = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum, process_set=mine)
    out["bcast"] = hvd.broadcast(torch.tensor([r * 10]), root_rank=r, process_set=mine)
    out["gather"] = hvd.allgather(torch.tensor([r]), process_set=mine)
    try:
        hvd.allreduce(torch.ones(1), process_set=other)
    except ValueError as exc:
        out["outsider"] = str(exc)
    hvd.barrier()
    out["removed"] = [hvd.remove_process_set(ps) for ps in sets]
    out["global"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)
    return out
