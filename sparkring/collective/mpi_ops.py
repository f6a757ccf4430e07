"""The public tensor collectives of the Horovod API inside a rank, each defined here with its
Arguments and Returns (as horovod/torch/mpi_ops.py): allreduce, allgather, broadcast, alltoall and
reducescatter in their plain, in-place, grouped and async forms, and poll, synchronize, barrier, join.
How each travels lives below: _reduce (allreduce), _gather (the others), _autograd (their gradients)."""
from __future__ import annotations

import contextlib
from typing import List, Optional, Union

import torch

from ..errors import MismatchError
from . import _autograd, _checks, _gather, _pending, _reduce, _runtime, _sparse
from ._backend import Handle
from ._join import Recipe
from .compression import Compression
from .process_sets import ProcessSet, accepts_process_set, backend_of

# Horovod's reduction ops: pass one as ``op=``.
Average = _reduce.Average
Sum = _reduce.Sum
Min = _reduce.Min
Max = _reduce.Max
Product = _reduce.Product
Adasum = _reduce.Adasum


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
    return _autograd.reduce(tensor, _reduce.resolve_op(average, op), compression, prescale_factor, postscale_factor,
                            name)


@accepts_process_set
@_reduce.timed("ALLREDUCE")
def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[str] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place and return it.

    Arguments:
        tensor: reduced in place.
        average, name, op, prescale_factor, postscale_factor, process_set: as in ``allreduce``.
    Returns:
        ``tensor``, now holding the reduction.

    >>> t = torch.ones(2); sr.allreduce_(t, op=sr.Sum)  # doctest: +SKIP
    """
    return synchronize(_reduce.allreduce_start(tensor, tensor, _reduce.resolve_op(average, op), Compression.none,
                                       prescale_factor, postscale_factor, blocking=True, name=name, checked=True))


@accepts_process_set
def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[str] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, compression=Compression.none) -> Handle:
    """Start an allreduce; ``synchronize(handle)`` returns the result.

    Arguments:
        tensor, average, name, op, prescale_factor, postscale_factor, process_set: as in ``allreduce``.
    Returns:
        A handle: ``sr.synchronize(handle)`` waits and gives the reduced tensor, ``sr.poll(handle)``
        says whether it is done.

    >>> h = sr.allreduce_async(torch.ones(3)); sr.synchronize(h)  # doctest: +SKIP
    tensor([1., 1., 1.])
    """
    op = _reduce.resolve_op(average, op)
    return _pending.defer("allreduce", name, lambda: _reduce.allreduce_start(
        tensor, None, op, compression, prescale_factor, postscale_factor, name=name, checked=True), "allreduce_async")


@accepts_process_set
def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[str] = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> Handle:
    """In-place variant of ``allreduce_async``.

    Arguments:
        tensor: reduced in place once the handle is synchronized.
        average, name, op, prescale_factor, postscale_factor, process_set: as in ``allreduce``.
    Returns:
        A handle; ``sr.synchronize(handle)`` gives ``tensor``, holding the reduction.

    >>> h = sr.allreduce_async_(t); sr.synchronize(h)  # doctest: +SKIP
    """
    op = _reduce.resolve_op(average, op)
    return _pending.defer("allreduce", name, lambda: _reduce.allreduce_start(
        tensor, tensor, op, Compression.none, prescale_factor, postscale_factor, name=name, checked=True),
        "allreduce_async_")


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
    return _autograd.reduce_grouped(tensors, _reduce.resolve_op(average, op), compression, prescale_factor,
                                    postscale_factor)


@accepts_process_set
def grouped_allreduce_(tensors: List[torch.Tensor], **kwargs) -> List[torch.Tensor]:
    """In-place variant of ``grouped_allreduce``.

    Arguments:
        tensors: each reduced in place.
        average, name, op, prescale_factor, postscale_factor, process_set: as in ``allreduce``.
    Returns:
        ``tensors``, each now holding its reduction.

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
    return _autograd.gather(tensor, name)


@accepts_process_set
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None) -> Handle:
    """Start an allgather; ``synchronize(handle)`` returns the result. (The exchange runs when
    it is issued: gloo and MPI serve one collective at a time per ring.)

    Arguments:
        tensor, name, process_set: as in ``allgather``.
    Returns:
        A handle; ``sr.synchronize(handle)`` gives the gathered tensor.

    >>> sr.synchronize(sr.allgather_async(torch.ones(2)))  # doctest: +SKIP
    """
    return _pending.defer("allgather", name, lambda: _gather.allgather_now(tensor, name), "allgather_async")


@accepts_process_set
def grouped_allgather(tensors: List[torch.Tensor], name: Optional[str] = None) -> List[torch.Tensor]:
    """Allgather each tensor of a list.

    Arguments:
        tensors: this rank's tensors; for each, every dimension but the first agrees across ranks.
        name, process_set: as in ``allgather``.
    Returns:
        A list of new tensors, each the allgather of the tensor at its position.

    >>> a, b = sr.grouped_allgather([torch.ones(1), torch.zeros(2, 3)])  # doctest: +SKIP
    """
    return [allgather(t, name=f"{name}.{i}" if name else None) for i, t in enumerate(tensors)]


@accepts_process_set
def grouped_allgather_async(tensors: List[torch.Tensor], name: Optional[str] = None) -> Handle:
    """Start a grouped allgather; ``synchronize(handle)`` returns the list of results.

    Arguments:
        tensors, name, process_set: as in ``grouped_allgather``.
    Returns:
        A handle; ``sr.synchronize(handle)`` gives the list of gathered tensors.

    >>> outs = sr.synchronize(sr.grouped_allgather_async([a, b]))  # doctest: +SKIP
    """
    return _pending.defer("allgather", name, lambda: [_gather.allgather_now(t, f"{name}.{i}" if name else None)
                                                     for i, t in enumerate(tensors)], "grouped_allgather_async")


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
    if _autograd.differentiable(tensor):
        return _autograd.Broadcast.apply(tensor, root_rank, name)
    return synchronize(_gather.broadcast_start(tensor.clone(), root_rank, name))


@accepts_process_set
@_reduce.timed("BROADCAST")
def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
    """Overwrite ``tensor`` with root's copy, in place.

    Arguments:
        tensor: overwritten in place with ``root_rank``'s values.
        root_rank, name, process_set: as in ``broadcast``.
    Returns:
        ``tensor``.

    >>> sr.broadcast_(w, root_rank=0)  # doctest: +SKIP
    """
    return synchronize(_gather.broadcast_start(tensor, root_rank, name))


@accepts_process_set
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Start a broadcast from ``root_rank`` into a new tensor.

    Arguments:
        tensor, root_rank, name, process_set: as in ``broadcast``.
    Returns:
        A handle; ``sr.synchronize(handle)`` gives a new tensor with root's values.

    >>> sr.synchronize(sr.broadcast_async(t, 0))  # doctest: +SKIP
    """
    copy = tensor.clone()
    return _pending.defer("broadcast", name, lambda: _gather.broadcast_start(copy, root_rank, name), "broadcast_async")


@accepts_process_set
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Start an in-place broadcast from ``root_rank``.

    Arguments:
        tensor, root_rank, name, process_set: as in ``broadcast_``.
    Returns:
        A handle; ``sr.synchronize(handle)`` gives ``tensor``, overwritten with root's values.

    >>> sr.synchronize(sr.broadcast_async_(t, 0))  # doctest: +SKIP
    """
    return _pending.defer("broadcast", name, lambda: _gather.broadcast_start(tensor, root_rank, name),
                          "broadcast_async_")


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
    if _autograd.differentiable(tensor):
        output, received = _autograd.Alltoall.apply(tensor, splits, name)
    else:
        output, received = _gather.alltoall_now(tensor, splits, name)
    return output if splits is None else (output, received)


@accepts_process_set
def alltoall_async(tensor: torch.Tensor, splits: Optional[Union[List[int], torch.Tensor]] = None,
                   name: Optional[str] = None) -> Handle:
    """Start an alltoall; ``synchronize(handle)`` returns what ``alltoall`` would.

    Arguments:
        tensor, splits, name, process_set: as in ``alltoall``.
    Returns:
        A handle; ``sr.synchronize(handle)`` gives what ``alltoall`` returns.

    >>> out, received = sr.synchronize(sr.alltoall_async(t, splits=[1, 3]))  # doctest: +SKIP
    """
    def start():
        output, received = _gather.alltoall_now(tensor, splits, name)
        return output if splits is None else (output, received)

    return _pending.defer("alltoall", name, start, "alltoall_async")


@accepts_process_set
def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression=Compression.none,
                  op: str = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
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
    _gather.check_reducescatter(tensor, op)
    compressed, ctx = compression.compress(tensor)
    if _autograd.differentiable(compressed):
        reduced = _autograd.Reducescatter.apply(compressed, op, prescale_factor, postscale_factor)
    else:
        reduced = _gather.reducescatter_now(compressed, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


@accepts_process_set
def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: str = Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter; ``synchronize(handle)`` returns this rank's slice.

    Arguments:
        tensor, name, op, prescale_factor, postscale_factor, process_set: as in ``reducescatter``.
    Returns:
        A handle; ``sr.synchronize(handle)`` gives this rank's slice.

    >>> part = sr.synchronize(sr.reducescatter_async(torch.ones(4, 2), op=sr.Sum))  # doctest: +SKIP
    """
    _gather.check_reducescatter(tensor, op)
    return _pending.defer("reducescatter", name, lambda: _gather.reducescatter_now(tensor, op, prescale_factor,
                                                                         postscale_factor, name), "reducescatter_async")


@accepts_process_set
def grouped_reducescatter(tensors: List[torch.Tensor], name: Optional[str] = None, compression=Compression.none,
                          op: str = Average, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """Reducescatter each tensor of a list.

    Arguments:
        tensors: the tensors to reduce; dimension 0 of each is scattered.
        name, compression, op, prescale_factor, postscale_factor, process_set: as in ``reducescatter``.
    Returns:
        A list: this rank's slice of each reduced tensor.

    >>> a, b = sr.grouped_reducescatter([torch.ones(4), torch.ones(2, 2)])  # doctest: +SKIP
    """
    return [reducescatter(t, compression=compression, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor) for t in tensors]


@accepts_process_set
def grouped_reducescatter_async(tensors: List[torch.Tensor], name: Optional[str] = None, op: str = Average,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start a grouped reducescatter; ``synchronize(handle)`` returns the list of slices.

    Arguments:
        tensors, name, op, prescale_factor, postscale_factor, process_set: as in ``grouped_reducescatter``.
    Returns:
        A handle; ``sr.synchronize(handle)`` gives the list of slices.

    >>> parts = sr.synchronize(sr.grouped_reducescatter_async([a, b]))  # doctest: +SKIP
    """
    for t in tensors:
        _gather.check_reducescatter(t, op)
    return _pending.defer("reducescatter", name,
                          lambda: [_gather.reducescatter_now(t, op, prescale_factor, postscale_factor)
                                   for t in tensors],
                          "grouped_reducescatter_async")


@accepts_process_set
def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str], op: str):
    """Allreduce a sparse (COO) tensor as Horovod does: allgather its indices and values;
    ``synchronize(handle)`` (or ``handle()``) returns the sparse sum (or average).

    Arguments:
        tensor: a sparse COO tensor (e.g. an embedding's gradient).
        name: a name the ranks agree on.
        op: ``sr.Average`` or ``sr.Sum``.
    Returns:
        A handle; ``sr.synchronize(handle)`` gives the sparse reduction.

    >>> grad = sr.synchronize(sr.sparse_allreduce_async(emb.weight.grad, "emb", sr.Average))  # doctest: +SKIP
    """
    return _sparse.allreduce_one(tensor, name, op)


def poll(handle: Handle) -> bool:
    """True when the asynchronous operation behind ``handle`` has finished.

    Arguments:
        handle: what an ``*_async`` call returned.
    Returns:
        True once the operation is done (``synchronize`` then returns at once).

    >>> sr.poll(h)  # doctest: +SKIP
    True
    """
    return handle.is_completed()


def synchronize(handle: Handle):
    """Wait for an asynchronous operation and return its output.

    Arguments:
        handle: what an ``*_async`` call returned.
    Returns:
        The operation's output (the reduced, gathered or broadcast tensor).

    >>> sr.synchronize(sr.allreduce_async(torch.ones(1)))  # doctest: +SKIP
    tensor([1.])
    """
    if callable(handle) and not isinstance(handle, Handle):  # sparse_allreduce_async's, as Horovod's
        return handle()
    if isinstance(handle, _pending.DeferredHandle):
        with _runtime.scope(handle.op.scope):
            while not handle.op.started:
                try:
                    _checks.agree(_checks.SYNC, name=handle.op.key)
                except MismatchError as exc:
                    _pending.abandon(handle.op, exc)  # its handle raised: it never runs
                    raise
    _pending.release(handle)
    return handle.wait()


def barrier(process_set: Optional[ProcessSet] = None) -> None:
    """Block until every rank (of ``process_set``, positional as in Horovod) reaches this call.

    Arguments:
        process_set: wait for the ranks of this ``sr.ProcessSet`` only.
    Returns:
        None, once every rank (of the set) called it.

    >>> sr.barrier()  # doctest: +SKIP
    >>> sr.barrier(evens)  # doctest: +SKIP
    """
    subset = backend_of(process_set)
    with _runtime.scope(subset) if subset is not None else contextlib.nullcontext():
        b = _runtime.current()
        seq = _runtime.enter(Recipe("barrier"))
        if b.size > 1:
            _checks.agree("barrier")  # an allgather: a barrier that also runs what ranks queued before it
        _runtime.completed(seq)


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, take part in the other
    ranks' collectives with neutral inputs, then return the rank that joined last.

    While a rank is joined it contributes zeros to allreduce (``Average`` still divides
    by ``size()``, as in Horovod; Min/Max/Product get their identity instead of zeros),
    no rows to allgather/alltoall, ``None`` to allgather_object, and receives broadcasts.
    A broadcast *from* a joined rank fails that rank with an error naming it. Call it
    once per round (e.g. at the end of every epoch); ``device`` is accepted for Horovod
    compatibility (neutral tensors go where the backend needs them).

    Arguments:
        device: as in Horovod, the device of the joined rank's neutral inputs (-1: the rank's own).
    Returns:
        The rank that joined last.

    >>> for batch in my_uneven_shard:  # doctest: +SKIP
    ...     loss_fn(model(batch)).backward(); opt.step()
    >>> last = sr.join()  # doctest: +SKIP
    """
    b = _runtime.current()
    joiner = _runtime.state.joiner
    return b.rank if joiner is None else joiner.join()
