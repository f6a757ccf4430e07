"""The collectives that take part in autograd, with Horovod's gradient rules (horovod/torch/mpi_ops.py):
allreduce's gradient is the allreduce of the gradient (same op and scaling); allgather's is
this rank's slice of the averaged gradient; broadcast's is the averaged gradient on the root
and zero elsewhere; alltoall routes gradients back by the received splits; reducescatter's
is the allgather of the (rescaled) gradient. mpi_ops uses them only when a tensor
requires grad, so the plain path (the ``*_now`` forms of _reduce and _gather) pays nothing."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from . import _gather, _reduce, _runtime, basics
from .compression import Compression


def _in_forwards_set(backward):
    """Run a backward in the process set its forward ran in (autograd calls it later)."""

    def wrapped(ctx: Any, *grads):
        with _runtime.scope(ctx.set_backend):
            return backward(ctx, *grads)

    return wrapped


def _remember_set(ctx: Any) -> None:
    ctx.set_backend = _runtime.active_set_backend()


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: str, compression, prescale: float, postscale: float, name):
        _remember_set(ctx)
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return _reduce.allreduce_now(tensor, op, compression, prescale, postscale, name)

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, grad: torch.Tensor):
        reduced = reduce(grad.contiguous(), ctx.op, prescale=ctx.prescale, postscale=ctx.postscale)
        return reduced, None, None, None, None, None


class GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: str, compression, prescale: float, postscale: float, *tensors: torch.Tensor):
        _remember_set(ctx)
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return tuple(_reduce.grouped_allreduce_now(list(tensors), op, compression, prescale, postscale))

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, *grads: torch.Tensor):
        reduced = reduce_grouped([g.contiguous() for g in grads], ctx.op, prescale=ctx.prescale,
                                 postscale=ctx.postscale)
        return (None, None, None, None, *reduced)


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name):
        _remember_set(ctx)
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return _gather.allgather_now(tensor, name)

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, grad: torch.Tensor):
        reduced = reduce(grad.contiguous(), _reduce.Average)
        rows = _gather.allgather_now(torch.tensor([ctx.rows], dtype=torch.int64))
        offset = int(rows[:basics.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name):
        _remember_set(ctx)
        ctx.root_rank = root_rank
        return _gather.broadcast_start(tensor.detach().clone(), root_rank, name).wait()

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, grad: torch.Tensor):
        reduced = reduce(grad.contiguous(), _reduce.Average)
        if _runtime.global_rank() != ctx.root_rank:  # root_rank is global, as in Horovod
            reduced = reduced * 0
        return reduced, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits, name) -> Tuple[torch.Tensor, torch.Tensor]:
        _remember_set(ctx)
        output, received = _gather.alltoall_now(tensor, splits, name)
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, grad: torch.Tensor, _received_grad):
        back, _ = _gather.alltoall_now(grad.contiguous(), ctx.received.tolist())
        return back, None, None


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: str, prescale: float, postscale: float):
        _remember_set(ctx)
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return _gather.reducescatter_now(tensor, op, prescale, postscale)

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, grad: torch.Tensor):
        # Horovod's rule, kept as is (Sum multiplies by the ring size)
        if ctx.op == _reduce.Sum:
            grad = grad * basics.size()
        if ctx.prescale != 1.0:
            grad = grad * ctx.prescale
        if ctx.postscale != 1.0:
            grad = grad * ctx.postscale
        return gather(grad.contiguous()), None, None, None


# -- the public collectives that take part in autograd -----------------------------


# -- the differentiable forms the gradients above use (a gradient's gradient for higher orders) --

def differentiable(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def reduce(tensor: torch.Tensor, op: str, compression=None, prescale: float = 1.0, postscale: float = 1.0,
           name: Optional[str] = None) -> torch.Tensor:
    """Allreduce, through autograd when ``tensor`` requires grad."""
    compression = compression or Compression.none
    if differentiable(tensor):
        return Allreduce.apply(tensor, op, compression, prescale, postscale, name)
    return _reduce.allreduce_now(tensor, op, compression, prescale, postscale, name)


def reduce_grouped(tensors: List[torch.Tensor], op: str, compression=None, prescale: float = 1.0,
                   postscale: float = 1.0) -> List[torch.Tensor]:
    """Grouped allreduce, through autograd when a tensor requires grad."""
    compression = compression or Compression.none
    if differentiable(*tensors):
        return list(GroupedAllreduce.apply(op, compression, prescale, postscale, *tensors))
    return _reduce.grouped_allreduce_now(tensors, op, compression, prescale, postscale)


def gather(tensor: torch.Tensor, name: Optional[str] = None) -> torch.Tensor:
    """Allgather, through autograd when ``tensor`` requires grad."""
    if differentiable(tensor):
        return Allgather.apply(tensor, name)
    return _gather.allgather_now(tensor, name)
