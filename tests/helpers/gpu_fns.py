"""Rank functions of the GPU-independent checks of GPU code paths (SyncBatchNorm in float16)
and of tests/gpu (which run them on CUDA tensors)."""
import torch

import sparkring.collective as sr


def sync_batch_norm_half(shape=(16, 2, 64, 64), device="cpu", seed=0):
    """Every rank normalises its part of one float16 batch with SyncBatchNorm; returns its
    output and the whole batch, which the test normalises with float32 BatchNorm."""
    g = torch.Generator().manual_seed(seed)
    whole = (torch.randn((shape[0] * sr.size(),) + tuple(shape[1:]), generator=g) * 3 + 1).half()
    mine = whole[sr.rank() * shape[0]:(sr.rank() + 1) * shape[0]].to(device)
    bn = sr.SyncBatchNorm(shape[1]).to(device).half()
    out = bn(mine)
    out.float().sum().backward()
    return {"out": out.float().cpu(), "whole": whole, "running_var": bn.running_var.float().cpu()}


def _ops_on(device, seed=0):
    """The same collectives on tensors on ``device`` (values identical on every device)."""
    r, n = sr.rank(), sr.size()
    g = torch.Generator().manual_seed(seed + r)
    x = torch.randn(1000, generator=g).to(device)
    out = {
        "avg": sr.allreduce(x), "sum": sr.allreduce(x, op=sr.Sum), "min": sr.allreduce(x, op=sr.Min),
        "max": sr.allreduce(x, op=sr.Max),
        "grouped": sr.grouped_allreduce([x, x[:7] * 2], op=sr.Sum),
        "gather": sr.allgather(torch.full((r + 1, 3), float(r)).to(device)),
        "bcast": sr.broadcast(x, root_rank=n - 1),
        "alltoall": sr.alltoall(torch.arange(4 * n, dtype=torch.float32).to(device) + 100 * r),
        "reducescatter": sr.reducescatter(torch.arange(4 * n, dtype=torch.float32).to(device) * (r + 1)),
    }
    if n & (n - 1) == 0:
        out["adasum"] = sr.allreduce(x, op=sr.Adasum)
    return out


def cuda_tour():
    """Every collective on CUDA tensors equals the same collective on CPU tensors, and the
    results stay on the rank's own GPU."""
    on_gpu = _ops_on(torch.device("cuda", torch.cuda.current_device()))
    on_cpu = _ops_on(torch.device("cpu"))
    where = {k: [t.device.type for t in (v if isinstance(v, list) else [v])] for k, v in on_gpu.items()}
    diffs = {}
    for key in on_cpu:
        a, b = on_gpu[key], on_cpu[key]
        a, b = (a, b) if isinstance(a, list) else ([a], [b])
        diffs[key] = max(float((x.cpu() - y).abs().max()) if y.numel() else 0.0 for x, y in zip(a, b))
    return {"rank": sr.rank(), "local_rank": sr.local_rank(), "backend": sr.backend(),
            "current_device": torch.cuda.current_device(), "where": where, "diffs": diffs}


def train_on_gpu(steps=4):
    """rank_fns.train_distributed with the model and batches on the rank's GPU."""
    from rank_fns import make_batches, make_model

    device = torch.device("cuda", torch.cuda.current_device())
    model = make_model(seed=0 if sr.rank() == 0 else 100 + sr.rank()).to(device)
    sr.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = sr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters())
    half = 8 // sr.size()
    lo, hi = sr.rank() * half, (sr.rank() + 1) * half
    for x, y in make_batches(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[lo:hi].to(device)), y[lo:hi].to(device)).backward()
        opt.step()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def touch_cuda(_):
    """Run in Spark's Python workers before a GPU run: they have used CUDA when ranks start."""
    torch.zeros(1, device="cuda")
    return [torch.cuda.is_initialized()]
