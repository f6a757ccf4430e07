"""Tensor collectives of the Horovod API inside a rank: allreduce (and its async, in-place and
grouped forms), allgather, broadcast, alltoall, reducescatter, barrier and join."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple, Union

import torch

from . import _checks, _runtime
from ._backend import Handle
from ._handles import DoneHandle, PostHandle
from ._join import Recipe
from .compression import Compression

Average = "Average"
Sum = "Sum"
Min = "Min"
Max = "Max"
Product = "Product"
Adasum = "Adasum"
REDUCE_OPS = {Sum: "sum", Average: "sum", Min: "min", Max: "max", Product: "product"}


def to_wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as the backend carries it: on its device, in a dtype it supports (gloo has
    no int16: it travels as int32 and comes back narrowed)."""
    b = _runtime.current()
    dev = b.device
    dtype = b.wire_dtype(tensor.dtype)
    if (dev is not None and tensor.device != dev) or dtype != tensor.dtype:
        return tensor.to(device=dev if dev is not None else tensor.device, dtype=dtype)
    return tensor


def scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor * factor`` in Horovod's way: integer tensors stay integer, truncated toward
    zero (its C++ core multiplies by a double and casts back)."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return tensor * factor
    if tensor.dtype == torch.bool:
        return tensor if factor else torch.zeros_like(tensor)
    return (tensor.double() * factor).trunc().to(tensor.dtype)


def _resolve_op(average: Optional[bool], op: Optional[str]) -> str:
    if average is not None and op is not None:
        raise ValueError("allreduce: pass either average= (deprecated) or op=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op not in REDUCE_OPS and op != Adasum:
        raise ValueError(f"allreduce: op={op!r} is not known; use one of "
                         "Average, Sum, Min, Max, Product, Adasum")
    return op


def allreduce_start(tensor: torch.Tensor, out: Optional[torch.Tensor], op: str,
                     compression=Compression.none, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, blocking: bool = False,
                     path: Optional[str] = None) -> Handle:
    """Start (or, with ``blocking``, run) one allreduce. ``path`` is how it travels: "new"
    (out-of-place straight into a new tensor), "blocking" or "async"; decided here from the
    call and recorded, so a joined rank replaying it takes the very same path."""
    b = _runtime.current()
    if tensor.numel() == 0:
        result = out if out is not None else tensor.clone()
        return DoneHandle(result)
    recipe = Recipe("allreduce", shape=tuple(tensor.shape), dtype=str(tensor.dtype), op=op,
                    compression=f"{compression.__module__}:{compression.__qualname__}",
                    prescale=prescale_factor, postscale=postscale_factor)
    if op == Adasum:
        seq = _runtime.enter(dataclasses.replace(recipe, path="adasum"))
        from ._adasum import adasum_allreduce

        result = adasum_allreduce(tensor, b)
        _runtime.completed(seq)
        if out is not None:
            out.copy_(result)
            result = out
        return DoneHandle(result)
    work = tensor
    if prescale_factor != 1.0:
        work = scale(work, prescale_factor)
    compressed, ctx = compression.compress(work)
    wire = to_wire(compressed)
    if not wire.is_contiguous():
        wire = wire.contiguous()
    if path is None:
        if not blocking:
            path = "async"
        elif out is None and compressed is tensor and b.out_of_place_applies(wire):
            path = "new"
        else:
            path = "blocking"
    seq = _runtime.enter(dataclasses.replace(recipe, path=path))
    if wire is tensor and path != "new" and out is not tensor:  # never reduce into the caller's tensor
        wire = b.result_like(tensor).copy_(tensor)
    size_ = b.size
    is_float = tensor.dtype.is_floating_point or tensor.dtype.is_complex

    def finish(reduced: torch.Tensor) -> torch.Tensor:
        _runtime.completed(seq)
        if reduced.dtype != compressed.dtype:  # widened for the wire
            reduced = reduced.to(compressed.dtype)
        result = compression.decompress(reduced, ctx)
        if result.device != tensor.device:
            result = result.to(tensor.device)
        if op == Average and not is_float:  # one truncating scale by postscale/size, as Horovod
            result = scale(result, postscale_factor / size_)
        else:
            if op == Average:
                result = result / size_ if result is not reduced else result.div_(size_)
            if postscale_factor != 1.0:
                result = scale(result, postscale_factor)
        if out is not None:
            if result is not out:
                out.copy_(result)
            return out
        return result

    if path == "new":
        return DoneHandle(finish(b.allreduce_new(wire, REDUCE_OPS[op])))
    if path == "blocking":
        return DoneHandle(finish(b.allreduce(wire, REDUCE_OPS[op])))
    return PostHandle(b.allreduce_async(wire, REDUCE_OPS[op]), finish)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[str] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, compression=Compression.none) -> Handle:
    """Start an allreduce; ``synchronize(handle)`` returns the result.

    >>> h = sr.allreduce_async(torch.ones(3)); sr.synchronize(h)  # doctest: +SKIP
    tensor([1., 1., 1.])
    """
    _checks.check_name(name, tensor, "allreduce")
    return allreduce_start(tensor, None, _resolve_op(average, op), compression,
                            prescale_factor, postscale_factor)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[str] = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> Handle:
    """In-place variant of ``allreduce_async``.

    >>> h = sr.allreduce_async_(t); sr.synchronize(h)  # doctest: +SKIP
    """
    _checks.check_name(name, tensor, "allreduce")
    return allreduce_start(tensor, tensor, _resolve_op(average, op), Compression.none,
                            prescale_factor, postscale_factor)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression=Compression.none, op: Optional[str] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (default: average) and return a new tensor.

    >>> sr.allreduce(torch.tensor([float(sr.rank())]))  # 2 ranks  # doctest: +SKIP
    tensor([0.5000])
    """
    _checks.check_name(name, tensor, "allreduce")
    return synchronize(allreduce_start(tensor, None, _resolve_op(average, op), compression,
                                        prescale_factor, postscale_factor, blocking=True))


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[str] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place and return it.

    >>> t = torch.ones(2); sr.allreduce_(t, op=sr.Sum)  # doctest: +SKIP
    """
    _checks.check_name(name, tensor, "allreduce")
    return synchronize(allreduce_start(tensor, tensor, _resolve_op(average, op),
                                        Compression.none, prescale_factor, postscale_factor, blocking=True))


def grouped_allreduce(tensors: List[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression=Compression.none,
                      op: Optional[str] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """Allreduce a list of tensors as one fused operation per dtype.

    >>> a, b = sr.grouped_allreduce([torch.ones(2), torch.zeros(3)])  # doctest: +SKIP
    """
    op = _resolve_op(average, op)
    if op == Adasum:
        return [allreduce(t, op=op) for t in tensors]
    results: List[Optional[torch.Tensor]] = [None] * len(tensors)
    by_dtype: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault((t.dtype, t.device), []).append(i)
    handles = []
    for idx in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        handles.append((idx, allreduce_start(flat, flat, op, compression, prescale_factor,
                                              postscale_factor)))
    for idx, h in handles:
        flat = h.wait()
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            results[i] = flat[offset:offset + n].view_as(tensors[i])
            offset += n
    return results  # type: ignore[return-value]


def grouped_allreduce_(tensors: List[torch.Tensor], **kwargs) -> List[torch.Tensor]:
    """In-place variant of ``grouped_allreduce``.

    >>> sr.grouped_allreduce_([w1, w2])  # doctest: +SKIP
    """
    for t, r in zip(tensors, grouped_allreduce(tensors, **kwargs)):
        t.copy_(r)
    return tensors


def poll(handle: Handle) -> bool:
    """True when the asynchronous operation behind ``handle`` has finished.

    >>> sr.poll(h)  # doctest: +SKIP
    True
    """
    return handle.is_completed()


def synchronize(handle: Handle) -> torch.Tensor:
    """Wait for an asynchronous operation and return its output.

    >>> sr.synchronize(sr.allreduce_async(torch.ones(1)))  # doctest: +SKIP
    tensor([1.])
    """
    return handle.wait()


def allgather(tensor: torch.Tensor, name: Optional[str] = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0; the first dimension may differ by rank.

    >>> sr.allgather(torch.full((sr.rank() + 1,), sr.rank()))  # 2 ranks  # doctest: +SKIP
    tensor([0, 1, 1])
    """
    b = _runtime.current()
    t = tensor if tensor.dim() > 0 else tensor.reshape(1)
    seq = _runtime.enter(Recipe("allgather", tail=tuple(t.shape[1:]), dtype=str(t.dtype)))
    wire = to_wire(t.contiguous())
    first = torch.tensor([t.shape[0]], dtype=torch.int64, device=wire.device)
    rest = torch.tensor(list(t.shape[1:]), dtype=torch.int64, device=wire.device)
    firsts = [int(x) for x in b.allgather_same_shape(first)]
    rests = b.allgather_same_shape(torch.cat([rest, torch.tensor([t.dim()], device=wire.device)]))
    for r, shape in enumerate(rests):
        if not torch.equal(shape, rests[b.rank]):
            raise ValueError(
                f"allgather{' ' + repr(name) if name else ''}: rank {r} sent a tensor of shape "
                f"(*, {', '.join(str(int(x)) for x in shape[:-1])}) but rank {b.rank} sent "
                f"{tuple(t.shape)}; all dimensions but the first must match")
    biggest = max(firsts)
    if biggest != t.shape[0]:
        pad = torch.zeros((biggest - t.shape[0],) + tuple(t.shape[1:]), dtype=wire.dtype,
                          device=wire.device)
        wire = torch.cat([wire, pad])
    parts = b.allgather_same_shape(wire)
    _runtime.completed(seq)
    out = torch.cat([p[:n] for p, n in zip(parts, firsts)])
    return out.to(device=tensor.device, dtype=tensor.dtype)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Start an in-place broadcast from ``root_rank``.

    >>> sr.synchronize(sr.broadcast_async_(t, 0))  # doctest: +SKIP
    """
    _checks.check_name(name, tensor, "broadcast")
    wire = to_wire(tensor)
    if tensor.numel() == 0:
        return DoneHandle(tensor)
    _runtime.enter(Recipe("broadcast", shape=tuple(tensor.shape), dtype=str(tensor.dtype), root=root_rank))
    inner = _runtime.current().broadcast_async(wire, root_rank)
    if wire is tensor:
        return inner

    def finish(result):
        tensor.copy_(result)
        return tensor

    return PostHandle(inner, finish)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Start a broadcast from ``root_rank`` into a new tensor.

    >>> sr.synchronize(sr.broadcast_async(t, 0))  # doctest: +SKIP
    """
    return broadcast_async_(tensor.clone(), root_rank, name)


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
    """Return root's copy of ``tensor`` on every rank.

    >>> sr.broadcast(torch.tensor([sr.rank()]), root_rank=0)  # doctest: +SKIP
    tensor([0])
    """
    return synchronize(broadcast_async(tensor, root_rank, name))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
    """Overwrite ``tensor`` with root's copy, in place.

    >>> sr.broadcast_(w, root_rank=0)  # doctest: +SKIP
    """
    return synchronize(broadcast_async_(tensor, root_rank, name))


def barrier() -> None:
    """Block until every rank reaches this call.

    >>> sr.barrier()  # doctest: +SKIP
    """
    b = _runtime.current()
    seq = _runtime.enter(Recipe("barrier"))
    b.barrier()
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

    >>> for batch in my_uneven_shard:  # doctest: +SKIP
    ...     loss_fn(model(batch)).backward(); opt.step()
    >>> last = sr.join()  # doctest: +SKIP
    """
    b = _runtime.current()
    joiner = _runtime.state.joiner
    return b.rank if joiner is None else joiner.join()


def alltoall(tensor: torch.Tensor, splits: Optional[Union[List[int], torch.Tensor]] = None,
             name: Optional[str] = None) -> torch.Tensor:
    """Scatter slices of ``tensor`` (dim 0, by ``splits``) to every rank and gather what
    they send back, concatenated by source rank.

    >>> sr.alltoall(torch.arange(4))  # 2 ranks: rank 0 gets [0, 1] + rank 1's [0, 1]  # doctest: +SKIP
    """
    b = _runtime.current()
    n = tensor.shape[0]
    if splits is None:
        if n % b.size:
            raise ValueError(f"alltoall: dim 0 of size {n} does not split evenly over {b.size} "
                             "ranks; pass splits=")
        splits = [n // b.size] * b.size
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != b.size or sum(splits) != n:
        raise ValueError(f"alltoall: splits {splits} must have {b.size} entries summing to {n}")
    seq = _runtime.enter(Recipe("alltoall", tail=tuple(tensor.shape[1:]), dtype=str(tensor.dtype)))
    wire = to_wire(tensor.contiguous())
    send_counts = torch.tensor(splits, dtype=torch.int64)
    recv_counts = [int(row[b.rank]) for row in b.allgather_same_shape(to_wire(send_counts))]
    inputs = list(torch.split(wire, splits))
    tail = tuple(tensor.shape[1:])
    outputs = [torch.empty((c,) + tail, dtype=tensor.dtype, device=wire.device) for c in recv_counts]
    b.alltoall(outputs, inputs)
    _runtime.completed(seq)
    return torch.cat(outputs).to(device=tensor.device, dtype=tensor.dtype)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression=Compression.none,
                  op: str = Average) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return this rank's slice of dim 0 (the first
    ranks get one row more when it does not divide evenly, as in Horovod).

    >>> sr.reducescatter(torch.ones(4, 2))  # 2 ranks: a (2, 2) tensor of ones  # doctest: +SKIP
    """
    b = _runtime.current()
    reduced = allreduce(tensor, op=op, compression=compression)
    n = tensor.shape[0]
    base, extra = divmod(n, b.size)
    start = b.rank * base + min(b.rank, extra)
    return reduced[start:start + base + (1 if b.rank < extra else 0)].clone()
