"""FSDP2's all-gather and reduce-scatter through the shared-memory ring, where every rank of
the ring is on one host: written by hand because gloo's ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` go through TCP loopback (3-10x slower than shared memory here, see
BENCHMARKS.md), and FSDP2 takes custom exchanges (``set_custom_all_gather``/``_reduce_scatter``)."""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from typing_extensions import override

from . import _runtime

log = logging.getLogger(__name__)


def _ring_for(tensor: torch.Tensor, group: dist.ProcessGroup):
    """The one-host shared-memory ring when it can serve ``tensor`` over ``group`` (the whole ring)."""
    ring_of = getattr(_runtime.current(), "single_host_ring", None)
    ring = ring_of() if ring_of is not None else None
    if ring is None or group.size() != ring.local_size or not ring.supports(tensor) or not tensor.is_contiguous():
        return None
    return ring


class SharedMemoryAllGather(AllGather):
    """FSDP2's parameter all-gather through shared memory (gloo's where it cannot serve)."""

    served = 0  # calls the shared-memory ring served, in this process

    @override
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @override
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Optional[dist.Work]:
        ring = _ring_for(input_tensor, group)
        if ring is None:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        ring.all_gather_into(input_tensor.view(-1), output_tensor.view(-1))
        SharedMemoryAllGather.served += 1
        return None


class SharedMemoryReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter (sum or average) through shared memory."""

    served = 0

    @override
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @override
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False) -> Optional[dist.Work]:
        ring = _ring_for(input_tensor, group)
        average = op == dist.ReduceOp.AVG
        if ring is None or not (average or op == dist.ReduceOp.SUM):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        ring.reduce_scatter_sum(input_tensor.view(-1), output_tensor.view(-1))
        if average:
            output_tensor.div_(group.size())
        SharedMemoryReduceScatter.served += 1
        return None


def use_shared_memory(model: torch.nn.Module) -> bool:
    """Route every FSDP2 unit of ``model`` through the shared-memory ring where the ring has one
    (every rank on this host, gloo, ``sharedMemory`` on); whether it did. Every rank calls it.

    >>> from sparkring.collective.fsdp import use_shared_memory
    >>> fully_shard(model, mesh=sr.device_mesh())  # doctest: +SKIP
    >>> use_shared_memory(model)  # doctest: +SKIP
    True
    """
    ring_of = getattr(_runtime.current(), "single_host_ring", None)
    if ring_of is None or ring_of() is None:
        return False
    gather, scatter = SharedMemoryAllGather(), SharedMemoryReduceScatter()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_custom_all_gather(gather)
        unit.set_custom_reduce_scatter(scatter)
    log.info("FSDP2's all-gathers and reduce-scatters of %d units go through shared memory", len(units))
    return bool(units)
