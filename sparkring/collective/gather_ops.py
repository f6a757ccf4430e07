"""The gathering, broadcasting and scattering collectives of the Horovod API inside a rank, in their
plain and async forms: allgather, broadcast, alltoall, reducescatter, and the sparse allreduce built on
allgather (ops has allreduce, barrier, join)."""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from . import _checks, _pending, _runtime
from ._backend import Handle
from ._handles import DoneHandle, PostHandle
from ._join import Recipe
from .compression import Compression
from .ops import Adasum, Average, Sum, _timed, allreduce_start, synchronize, to_wire
from .process_sets import accepts_process_set


@accepts_process_set
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None) -> Handle:
    """Start an allgather; ``synchronize(handle)`` returns the result. (The exchange runs when
    it is issued: gloo and MPI serve one collective at a time per ring.)

    >>> sr.synchronize(sr.allgather_async(torch.ones(2)))  # doctest: +SKIP
    """
    return _pending.defer("allgather", name, lambda: allgather_now(tensor, name), "allgather_async")


@accepts_process_set
def grouped_allgather_async(tensors: List[torch.Tensor], name: Optional[str] = None) -> Handle:
    """Start a grouped allgather; ``synchronize(handle)`` returns the list of results.

    >>> outs = sr.synchronize(sr.grouped_allgather_async([a, b]))  # doctest: +SKIP
    """
    return _pending.defer("allgather", name, lambda: [allgather_now(t, f"{name}.{i}" if name else None)
                                                     for i, t in enumerate(tensors)], "grouped_allgather_async")


@_timed("ALLGATHER")
def allgather_now(tensor: torch.Tensor, name: Optional[str] = None) -> torch.Tensor:
    """Allgather without autograd."""
    b = _runtime.current()
    t = tensor if tensor.dim() > 0 else tensor.reshape(1)
    seq = _runtime.enter(Recipe("allgather", tail=tuple(t.shape[1:]), dtype=str(t.dtype), name=name or ""))
    firsts = _checks.agree("allgather", t, name=name)
    wire = to_wire(t.contiguous())
    biggest = max(firsts)
    if biggest != t.shape[0]:
        pad = torch.zeros((biggest - t.shape[0],) + tuple(t.shape[1:]), dtype=wire.dtype,
                          device=wire.device)
        wire = torch.cat([wire, pad])
    parts = b.allgather_same_shape(wire)
    _runtime.completed(seq)
    out = torch.cat([p[:n] for p, n in zip(parts, firsts)])
    return out.to(device=tensor.device, dtype=tensor.dtype)


def broadcast_start(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Start an in-place broadcast from ``root_rank`` now (every rank issues it in the same order)."""
    _runtime.enter(Recipe("broadcast", shape=tuple(tensor.shape), dtype=str(tensor.dtype), root=root_rank,
                          name=name or ""))
    _checks.agree("broadcast", tensor, root=root_rank, name=name)
    if tensor.numel() == 0:
        return DoneHandle(tensor)
    wire = to_wire(tensor)
    b = _runtime.current()  # root_rank is a global rank, also in a process set (as Horovod)
    inner = b.broadcast_async(wire, b.group_rank(root_rank))
    if wire is tensor:
        return inner

    def finish(result):
        tensor.copy_(result)
        return tensor

    return PostHandle(inner, finish)


@accepts_process_set
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Start an in-place broadcast from ``root_rank``.

    >>> sr.synchronize(sr.broadcast_async_(t, 0))  # doctest: +SKIP
    """
    return _pending.defer("broadcast", name, lambda: broadcast_start(tensor, root_rank, name), "broadcast_async_")


@accepts_process_set
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Start a broadcast from ``root_rank`` into a new tensor.

    >>> sr.synchronize(sr.broadcast_async(t, 0))  # doctest: +SKIP
    """
    copy = tensor.clone()
    return _pending.defer("broadcast", name, lambda: broadcast_start(copy, root_rank, name), "broadcast_async")


@accepts_process_set
@_timed("BROADCAST")
def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
    """Overwrite ``tensor`` with root's copy, in place.

    Arguments:
        tensor: overwritten in place with ``root_rank``'s values.
        root_rank, name, process_set: as in ``broadcast``.

    Returns:
        ``tensor``.

    >>> sr.broadcast_(w, root_rank=0)  # doctest: +SKIP
    """
    return synchronize(broadcast_start(tensor, root_rank, name))


@accepts_process_set
def alltoall_async(tensor: torch.Tensor, splits: Optional[Union[List[int], torch.Tensor]] = None,
                   name: Optional[str] = None) -> Handle:
    """Start an alltoall; ``synchronize(handle)`` returns what ``alltoall`` would.

    >>> out, received = sr.synchronize(sr.alltoall_async(t, splits=[1, 3]))  # doctest: +SKIP
    """
    def start():
        output, received = alltoall_now(tensor, splits, name)
        return output if splits is None else (output, received)

    return _pending.defer("alltoall", name, start, "alltoall_async")


@_timed("ALLTOALL")
def alltoall_now(tensor: torch.Tensor, splits: Optional[Union[List[int], torch.Tensor]] = None,
                 name: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Alltoall without autograd: ``(output, received_splits)``."""
    b = _runtime.current()
    n = tensor.shape[0]
    if splits is None:
        if n % b.size:
            raise ValueError(f"alltoall: dim 0 of size {n} does not split evenly over {b.size} "
                             "ranks; pass splits=")
        splits = [n // b.size] * b.size
    if isinstance(splits, torch.Tensor) and (splits.dtype.is_floating_point or splits.dtype.is_complex
                                             or splits.dtype == torch.bool):
        raise ValueError(f"alltoall: splits is a {splits.dtype} tensor; pass integers (a torch.int32 tensor, as "
                         "Horovod, or a list of ints)")
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != b.size or sum(splits) != n:
        raise ValueError(f"alltoall: splits {splits} must have {b.size} entries summing to {n}")
    seq = _runtime.enter(Recipe("alltoall", tail=tuple(tensor.shape[1:]), dtype=str(tensor.dtype),
                                name=name or ""))
    _checks.agree("alltoall", tensor, name=name)
    wire = to_wire(tensor.contiguous())
    send_counts = torch.tensor(splits, dtype=torch.int64)
    recv_counts = [int(row[b.rank]) for row in b.allgather_same_shape(to_wire(send_counts))]
    inputs = list(torch.split(wire, splits))
    tail = tuple(tensor.shape[1:])
    outputs = [torch.empty((c,) + tail, dtype=wire.dtype, device=wire.device) for c in recv_counts]
    b.alltoall(outputs, inputs)
    _runtime.completed(seq)
    output = torch.cat(outputs).to(device=tensor.device, dtype=tensor.dtype)
    return output, torch.tensor(recv_counts, dtype=torch.int32)


def check_reducescatter(tensor: torch.Tensor, op: str) -> None:
    """Refuse, on the calling rank and before any transfer, what Horovod's reducescatter refuses."""
    if op == Adasum:
        raise NotImplementedError("reducescatter: op=Adasum is not supported (as in Horovod); use Average or Sum")
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter: op={op!r} is not supported; use Average or Sum (as Horovod)")
    if tensor.dim() == 0:
        raise ValueError("reducescatter: a scalar has no first dimension to scatter; pass a tensor of one or "
                         "more dimensions (e.g. tensor.reshape(1))")


@_timed("REDUCESCATTER")
def reducescatter_now(tensor: torch.Tensor, op: str = Average, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, name: Optional[str] = None) -> torch.Tensor:
    """Reducescatter without autograd or compression."""
    b = _runtime.current()
    seq = _runtime.enter(Recipe("reducescatter", shape=tuple(tensor.shape), dtype=str(tensor.dtype), op=op,
                                name=name or ""))
    _checks.agree("reducescatter", tensor, op, name=name)
    _runtime.completed(seq)
    reduced = synchronize(allreduce_start(tensor, None, op, Compression.none, prescale_factor, postscale_factor,
                                          blocking=True))
    n = tensor.shape[0]
    base, extra = divmod(n, b.size)
    start = b.rank * base + min(b.rank, extra)
    return reduced[start:start + base + (1 if b.rank < extra else 0)].clone()


@accepts_process_set
def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: str = Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter; ``synchronize(handle)`` returns this rank's slice.

    >>> part = sr.synchronize(sr.reducescatter_async(torch.ones(4, 2), op=sr.Sum))  # doctest: +SKIP
    """
    check_reducescatter(tensor, op)
    return _pending.defer("reducescatter", name, lambda: reducescatter_now(tensor, op, prescale_factor,
                                                                         postscale_factor, name), "reducescatter_async")


@accepts_process_set
def grouped_reducescatter_async(tensors: List[torch.Tensor], name: Optional[str] = None, op: str = Average,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start a grouped reducescatter; ``synchronize(handle)`` returns the list of slices.

    >>> parts = sr.synchronize(sr.grouped_reducescatter_async([a, b]))  # doctest: +SKIP
    """
    for t in tensors:
        check_reducescatter(t, op)
    return _pending.defer("reducescatter", name, lambda: [reducescatter_now(t, op, prescale_factor, postscale_factor)
                                                          for t in tensors], "grouped_reducescatter_async")


@accepts_process_set
def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str], op: str):
    """Allreduce a sparse (COO) tensor as Horovod does: allgather its indices and values;
    ``synchronize(handle)`` (or ``handle()``) returns the sparse sum (or average).

    >>> grad = sr.synchronize(sr.sparse_allreduce_async(emb.weight.grad, "emb", sr.Average))  # doctest: +SKIP
    """
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = allgather_now(t.indices().transpose(0, 1).contiguous(), f"{name}.indices" if name else None)
    values = allgather_now(t.values(), f"{name}.values" if name else None)
    size = _runtime.current().size

    def handle() -> torch.Tensor:
        reduced = values / size if op == Average else values
        return torch.sparse_coo_tensor(indices.transpose(0, 1), reduced, t.size())

    return handle
