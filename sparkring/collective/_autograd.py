"""The collectives that take part in autograd, with Horovod's gradient rules (horovod/torch/mpi_ops.py):
allreduce's gradient is the allreduce of the gradient (same op and scaling); allgather's is
this rank's slice of the averaged gradient; broadcast's is the averaged gradient on the root
and zero elsewhere; alltoall routes gradients back by the received splits; reducescatter's
is the allgather of the (rescaled) gradient. The public functions here use them only when a
tensor requires grad, so the plain path (``ops``' ``*_now`` forms, below this module) pays nothing."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import torch

from . import _runtime, gather_ops, ops
from .compression import Compression
from .process_sets import accepts_process_set


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
        return allreduce(grad.contiguous(), op=ctx.op, prescale_factor=ctx.prescale,
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
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=ctx.op,
                                        prescale_factor=ctx.prescale, postscale_factor=ctx.postscale)
        return (None, None, None, None, *reduced)


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name):
        _remember_set(ctx)
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return gather_ops.allgather_now(tensor, name)

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, grad: torch.Tensor):
        reduced = allreduce(grad.contiguous(), op=ops.Average)
        rows = gather_ops.allgather_now(torch.tensor([ctx.rows], dtype=torch.int64))
        offset = int(rows[:_runtime.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name):
        _remember_set(ctx)
        ctx.root_rank = root_rank
        return ops.synchronize(gather_ops.broadcast_start(tensor.detach().clone(), root_rank, name))

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, grad: torch.Tensor):
        reduced = allreduce(grad.contiguous(), op=ops.Average)
        if _runtime.global_rank() != ctx.root_rank:  # root_rank is global, as in Horovod
            reduced = reduced * 0
        return reduced, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits, name) -> Tuple[torch.Tensor, torch.Tensor]:
        _remember_set(ctx)
        output, received = gather_ops.alltoall_now(tensor, splits, name)
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    @_in_forwards_set
    def backward(ctx: Any, grad: torch.Tensor, _received_grad):
        back, _ = gather_ops.alltoall_now(grad.contiguous(), ctx.received.tolist())
        return back, None, None


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: str, prescale: float, postscale: float):
        _remember_set(ctx)
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return gather_ops.reducescatter_now(tensor, op, prescale, postscale)

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
        return allgather(grad.contiguous()), None, None, None


# -- the public collectives that take part in autograd -----------------------------

@accepts_process_set
def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression=Compression.none, op: Optional[str] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (default: average) and return a new tensor.

    Arguments:
        tensor: the tensor to reduce (any dtype the transport reduces; on the rank's device).
        average: deprecated, as in Horovod: use ``op``.
        name: a name the ranks agree on (the timeline shows it); default: one per call site.
        compression: how the tensor travels (``sr.Compression.fp16``, ``.bf16``; default none).
        op: ``sr.Average`` (default), ``sr.Sum``, ``sr.Min``, ``sr.Max``, ``sr.Product`` or ``sr.Adasum``.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        process_set: reduce within this ``sr.ProcessSet`` only (default: every rank).

    Returns:
        A new tensor of the same shape and dtype, the reduction over the ranks; differentiable
        (its gradient is the allreduce of the incoming gradient).

    >>> sr.allreduce(torch.tensor([float(sr.rank())]))  # 2 ranks  # doctest: +SKIP
    tensor([0.5000])
    """
    op = ops.resolve_op(average, op)
    if _differentiable(tensor):
        return Allreduce.apply(tensor, op, compression, prescale_factor, postscale_factor, name)
    return ops.allreduce_now(tensor, op, compression, prescale_factor, postscale_factor, name)


def _differentiable(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


@accepts_process_set
def grouped_allreduce(tensors: List[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression=Compression.none,
                      op: Optional[str] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """Allreduce a list of tensors as one fused operation per dtype.

    Arguments:
        tensors: the tensors to reduce, of any shapes.
        average, name, compression, op, prescale_factor, postscale_factor, process_set: as in ``allreduce``.

    Returns:
        A list of new tensors, each the reduction of the tensor at its position.

    >>> a, b = sr.grouped_allreduce([torch.ones(2), torch.zeros(3)])  # doctest: +SKIP
    """
    op = ops.resolve_op(average, op)
    if _differentiable(*tensors):
        return list(GroupedAllreduce.apply(op, compression, prescale_factor, postscale_factor, *tensors))
    return ops.grouped_allreduce_now(tensors, op, compression, prescale_factor, postscale_factor)


@accepts_process_set
def grouped_allreduce_(tensors: List[torch.Tensor], **kwargs) -> List[torch.Tensor]:
    """In-place variant of ``grouped_allreduce``.

    >>> sr.grouped_allreduce_([w1, w2])  # doctest: +SKIP
    """
    for t, r in zip(tensors, grouped_allreduce(tensors, **kwargs)):
        t.copy_(r)
    return tensors


@accepts_process_set
def allgather(tensor: torch.Tensor, name: Optional[str] = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0; the first dimension may differ by rank.

    Arguments:
        tensor: this rank's tensor; every dimension but the first must agree across ranks.
        name: a name the ranks agree on.
        process_set: gather within this ``sr.ProcessSet`` only.

    Returns:
        A new tensor: every rank's tensor concatenated along dimension 0, in rank order.

    >>> sr.allgather(torch.full((sr.rank() + 1,), sr.rank()))  # 2 ranks  # doctest: +SKIP
    tensor([0, 1, 1])
    """
    if _differentiable(tensor):
        return Allgather.apply(tensor, name)
    return gather_ops.allgather_now(tensor, name)


@accepts_process_set
def grouped_allgather(tensors: List[torch.Tensor], name: Optional[str] = None) -> List[torch.Tensor]:
    """Allgather each tensor of a list.

    >>> a, b = sr.grouped_allgather([torch.ones(1), torch.zeros(2, 3)])  # doctest: +SKIP
    """
    return [allgather(t, name=f"{name}.{i}" if name else None) for i, t in enumerate(tensors)]


@accepts_process_set
def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
    """Return root's copy of ``tensor`` on every rank.

    Arguments:
        tensor: the tensor to send (on ``root_rank``) or whose shape and dtype to receive into.
        root_rank: the rank whose values every rank gets.
        name: a name the ranks agree on.
        process_set: broadcast within this ``sr.ProcessSet`` only (``root_rank`` is a global rank).

    Returns:
        A new tensor holding ``root_rank``'s values (``tensor`` itself is left as it was).

    >>> sr.broadcast(torch.tensor([sr.rank()]), root_rank=0)  # doctest: +SKIP
    tensor([0])
    """
    if _differentiable(tensor):
        return Broadcast.apply(tensor, root_rank, name)
    return ops.synchronize(gather_ops.broadcast_start(tensor.clone(), root_rank, name))


@accepts_process_set
def alltoall(tensor: torch.Tensor, splits: Optional[Union[List[int], torch.Tensor]] = None,
             name: Optional[str] = None):
    """Scatter slices of ``tensor`` (dim 0, by ``splits``) to every rank and gather what
    they send back, concatenated by source rank. As in Horovod: without ``splits`` the
    output tensor; with ``splits`` the pair ``(output, received_splits)``.

    Arguments:
        tensor: the rows to scatter (dimension 0), in destination-rank order.
        splits: how many rows go to each rank (default: equal parts).
        name: a name the ranks agree on.
        process_set: exchange within this ``sr.ProcessSet`` only.

    Returns:
        The received rows concatenated by source rank; with ``splits``, the pair
        ``(output, received_splits)``.

    >>> sr.alltoall(torch.arange(4))  # 2 ranks: rank 0 gets [0, 1] + rank 1's [0, 1]  # doctest: +SKIP
    >>> out, received = sr.alltoall(t, splits=[1, 3])  # doctest: +SKIP
    """
    if _differentiable(tensor):
        output, received = Alltoall.apply(tensor, splits, name)
    else:
        output, received = gather_ops.alltoall_now(tensor, splits, name)
    return output if splits is None else (output, received)


@accepts_process_set
def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression=Compression.none,
                  op: str = ops.Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return this rank's slice of dim 0 (the first
    ranks get one row more when it does not divide evenly, as in Horovod).

    Arguments:
        tensor: the tensor to reduce; dimension 0 is what is scattered.
        name, compression, op, prescale_factor, postscale_factor, process_set: as in ``allreduce``
        (``op`` is ``sr.Average`` or ``sr.Sum``).

    Returns:
        This rank's slice of the reduced tensor along dimension 0.

    >>> sr.reducescatter(torch.ones(4, 2))  # 2 ranks: a (2, 2) tensor of ones  # doctest: +SKIP
    """
    gather_ops.check_reducescatter(tensor, op)
    compressed, ctx = compression.compress(tensor)
    if _differentiable(compressed):
        reduced = Reducescatter.apply(compressed, op, prescale_factor, postscale_factor)
    else:
        reduced = gather_ops.reducescatter_now(compressed, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


@accepts_process_set
def grouped_reducescatter(tensors: List[torch.Tensor], name: Optional[str] = None, compression=Compression.none,
                          op: str = ops.Average, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """Reducescatter each tensor of a list.

    >>> a, b = sr.grouped_reducescatter([torch.ones(4), torch.ones(2, 2)])  # doctest: +SKIP
    """
    return [reducescatter(t, compression=compression, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor) for t in tensors]
