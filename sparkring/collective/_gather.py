"""How the gathering, broadcasting and scattering collectives travel inside a rank (allgather, broadcast,
alltoall, reducescatter) and what they refuse; mpi_ops holds the public calls."""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from . import _checks, _runtime
from ._backend import Handle
from ._handles import DoneHandle, PostHandle
from ._join import Recipe
from ._reduce import Adasum, Average, Sum, allreduce_start, timed, to_wire
from .compression import Compression


@timed("ALLGATHER")
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


@timed("ALLTOALL")
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


@timed("REDUCESCATTER")
def reducescatter_now(tensor: torch.Tensor, op: str = Average, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, name: Optional[str] = None) -> torch.Tensor:
    """Reducescatter without autograd or compression."""
    b = _runtime.current()
    seq = _runtime.enter(Recipe("reducescatter", shape=tuple(tensor.shape), dtype=str(tensor.dtype), op=op,
                                name=name or ""))
    _checks.agree("reducescatter", tensor, op, name=name)
    _runtime.completed(seq)
    reduced = allreduce_start(tensor, None, op, Compression.none, prescale_factor, postscale_factor,
                              blocking=True).wait()
    n = tensor.shape[0]
    base, extra = divmod(n, b.size)
    start = b.rank * base + min(b.rank, extra)
    return reduced[start:start + base + (1 if b.rank < extra else 0)].clone()


