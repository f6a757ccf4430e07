"""Plain torch.distributed code, as written for torchrun/TorchDistributor, run by sparkring."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, BATCH, IN, OUT = 5, 8, 4, 2


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def reference(world_size):
    """One process on every rank's batch at once: what DDP must reproduce."""
    torch.manual_seed(0)
    model = torch.nn.Linear(IN, OUT)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, r) for r in range(world_size)))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def ddp_user_init():
    """The torchrun shape: env:// init, DDP, all_gather of the weights, destroy at the end."""
    dist.init_process_group("gloo", init_method="env://")
    torch.manual_seed(0)
    state = _train(DDP(torch.nn.Linear(IN, OUT)))
    w = state["weight"]
    gathered = [torch.zeros_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, w)
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                          "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    dist.destroy_process_group()
    return {"state": state, "gathered": gathered, "env": env}


def user_init_then_sr():
    import sparkring.collective as sr

    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    group = dist.group.WORLD
    total = sr.allreduce(torch.tensor([float(sr.rank() + 1)]), op=sr.Sum).item()
    return {"total": total, "same_group": dist.group.WORLD is group, "size": sr.size(), "backend": sr.backend()}


def sr_then_user_ddp():
    import sparkring.collective as sr

    rank = sr.rank()  # sparkring forms the default group first
    dist.init_process_group("gloo", init_method="env://")  # adopted, not an error
    torch.manual_seed(0)
    state = _train(DDP(torch.nn.Linear(IN, OUT)))
    return {"rank": rank, "state": state}


def ddp_fails_on_rank(bad_rank):
    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(IN, OUT))
    x, y = batch(0, dist.get_rank())
    if dist.get_rank() == bad_rank:
        raise RuntimeError(f"bad batch on rank {bad_rank}")
    torch.nn.functional.mse_loss(model(x), y).backward()
    return "unreachable"


def spark_style_train(lr):
    """A function as Spark's TorchDistributor docs show it: init, train, return from rank 0."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(IN, OUT))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    result = round(float(model.module.weight.sum()), 6) if dist.get_rank() == 0 else None
    dist.destroy_process_group()
    return result


def one_process_reference(lr, size=2):
    """What spark_style_train computes on ``size`` ranks, in one process: DDP averages the
    ranks' gradients, so each step applies the mean of the per-rank gradients."""
    torch.manual_seed(0)
    model = torch.nn.Linear(IN, OUT)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(size):
            x, y = batch(step, rank)
            (torch.nn.functional.mse_loss(model(x), y) / size).backward()
        opt.step()
    return round(float(model.weight.sum()), 6)


class _Branchy(torch.nn.Module):
    """A model with a branch the loss never uses (DDP needs find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(IN, OUT)
        self.unused = torch.nn.Linear(IN, OUT)

    def forward(self, x):
        return self.used(x)


def torchrun_habits(checkpoint_dir):
    """DistributedSampler shards, find_unused_parameters, a rank-0 checkpoint every rank reads."""
    from torch.utils.data import DistributedSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = DistributedSampler(list(range(10)), num_replicas=world, rank=rank, shuffle=True, seed=0)
    shards = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    torch.manual_seed(0)
    model = DDP(_Branchy(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    path = os.path.join(checkpoint_dir, "model.pt")
    if rank == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        torch.save(model.module.state_dict(), path)
    dist.barrier()
    restored = _Branchy()
    restored.load_state_dict(torch.load(path, weights_only=True))
    same = all(torch.equal(restored.state_dict()[k], v) for k, v in model.module.state_dict().items())
    dist.destroy_process_group()
    return {"shards": shards, "restored_equal": same}
