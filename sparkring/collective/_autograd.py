"""Gradients through the collectives, with Horovod's rules (horovod/torch/mpi_ops.py):
allreduce's gradient is the allreduce of the gradient (same op and scaling); allgather's is
this rank's slice of the averaged gradient; broadcast's is the averaged gradient on the root
and zero elsewhere; alltoall routes gradients back by the received splits; reducescatter's
is the allgather of the (rescaled) gradient. The public functions in ``ops`` use these only
when a tensor requires grad, so the plain path pays nothing."""
from __future__ import annotations

from typing import Any, Tuple

import torch

from . import _runtime, ops


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
        return ops.allreduce_now(tensor, op, compression, prescale, postscale, name)

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, grad: torch.Tensor):
        return ops.allreduce(grad.contiguous(), op=ctx.op, prescale_factor=ctx.prescale,
                             postscale_factor=ctx.postscale), None, None, None, None, None


class GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: str, compression, prescale: float, postscale: float, *tensors: torch.Tensor):
        _remember_set(ctx)
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return tuple(ops.grouped_allreduce_now(list(tensors), op, compression, prescale, postscale))

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, *grads: torch.Tensor):
        reduced = ops.grouped_allreduce([g.contiguous() for g in grads], op=ctx.op,
                                        prescale_factor=ctx.prescale, postscale_factor=ctx.postscale)
        return (None, None, None, None, *reduced)


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name):
        _remember_set(ctx)
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return ops.allgather_now(tensor, name)

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, grad: torch.Tensor):
        reduced = ops.allreduce(grad.contiguous(), op=ops.Average)
        rows = ops.allgather_now(torch.tensor([ctx.rows], dtype=torch.int64))
        offset = int(rows[:_runtime.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name):
        _remember_set(ctx)
        ctx.root_rank = root_rank
        return ops.synchronize(ops.broadcast_async(tensor.detach(), root_rank, name))

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, grad: torch.Tensor):
        reduced = ops.allreduce(grad.contiguous(), op=ops.Average)
        if _runtime.global_rank() != ctx.root_rank:  # root_rank is global, as in Horovod
            reduced = reduced * 0
        return reduced, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits, name) -> Tuple[torch.Tensor, torch.Tensor]:
        _remember_set(ctx)
        output, received = ops.alltoall_now(tensor, splits, name)
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, grad: torch.Tensor, _received_grad):
        back, _ = ops.alltoall_now(grad.contiguous(), ctx.received.tolist())
        return back, None, None


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: str, prescale: float, postscale: float):
        _remember_set(ctx)
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return ops.reducescatter_now(tensor, op, prescale, postscale)

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, grad: torch.Tensor):
        # Horovod's rule, kept as is (Sum multiplies by the ring size)
        if ctx.op == ops.Sum:
            grad = grad * _runtime.size()
        if ctx.prescale != 1.0:
            grad = grad * ctx.prescale
        if ctx.postscale != 1.0:
            grad = grad * ctx.postscale
        return ops.allgather(grad.contiguous()), None, None, None
