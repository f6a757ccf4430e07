"""What an update asks of the gradients: whether they are finite (on this rank, or on every rank where
each holds a different part of them), their global norm clipped (over tensor-parallel slices, fsdp
shards and pipeline stages alike), and, for a tensor-parallel model replicated across groups, their
average over the data-parallel ranks."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

import sparkring.collective as sr


def finite_here(model: torch.nn.Module) -> bool:
    """Whether every gradient this rank holds is finite: its part of a DTensor's, a sparse one's
    values (one host sync for the whole model). Where gradients are reduced, every rank's answer is the same.

    >>> m = torch.nn.Linear(2, 1); m(torch.ones(1, 2)).sum().backward(); finite_here(m)
    True
    """
    sums = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        if g.is_sparse:
            g = g.coalesce().values()
        if hasattr(g, "to_local"):
            g = g.to_local()
        sums.append(g.detach().float().abs().sum())
    return not sums or bool(torch.isfinite(torch.stack(sums).sum()))


def finite_everywhere(model: torch.nn.Module) -> bool:
    """Whether every rank's part of every gradient is finite (the same answer on every rank): for
    sharded, tensor- and pipeline-parallel models, whose ranks hold different gradients."""
    bad = 0.0 if finite_here(model) else 1.0
    return sr.allreduce(torch.tensor([bad]), op=sr.Max).item() == 0.0


def average_over(model: torch.nn.Module, dp_mesh: Any) -> None:
    """Average every gradient's local part over the data-parallel ranks (one allreduce per dtype):
    the ranks at one tp position hold the same slice, so the local parts line up."""
    import torch.distributed as dist

    if dp_mesh.size() == 1:
        return
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
             for p in model.parameters() if p.grad is not None]
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=dp_mesh.get_group())
        flat /= dp_mesh.size()
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def clip_norm(model: torch.nn.Module, max_norm: float, across: Optional[Any] = None) -> float:
    """Scale every gradient so that their global 2-norm is at most ``max_norm``; the norm before.
    A DTensor's norm is reduced over its mesh (tp slices, fsdp shards); ``across`` (a pipeline's
    process group) adds the other stages' parameters. Every rank computes the same norm.

    >>> m = torch.nn.Linear(2, 1); m(torch.ones(1, 2)).sum().backward(); round(clip_norm(m, 0.5), 3)
    1.732
    >>> round(float(torch.cat([p.grad.reshape(-1) for p in m.parameters()]).norm()), 3)
    0.5
    """
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    squares = []
    for g in grads:
        norm = torch.linalg.vector_norm(g.coalesce().values() if g.is_sparse else g, 2)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    if across is not None:
        dist.all_reduce(total, group=across)
    norm = float(total.sqrt())
    if norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm
