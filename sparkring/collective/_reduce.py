"""How an allreduce travels inside a rank: the op names, the start of one allreduce (scaling, compression,
the wire dtype, the path a joined rank replays), its blocking and grouped forms; mpi_ops holds the public calls."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch

from . import _checks, _runtime, timeline
from ._adasum import adasum_allreduce
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
_F = TypeVar("_F", bound=Callable[..., Any])


def timed(phase: str) -> Callable[[_F], _F]:
    """A blocking collective as a span of the timeline (Horovod's ``ALLREDUCE`` ...), with the
    bytes it reduces or sends and its name; its negotiation is the span inside it."""
    def decorate(fn: _F) -> _F:
        params = list(inspect.signature(fn).parameters)
        name_at = params.index("name") if "name" in params else None

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            recorder = timeline.recorder
            if not recorder.on:
                return fn(*args, **kwargs)
            began = recorder.now()
            result = fn(*args, **kwargs)
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            name = kwargs.get("name") or (args[name_at] if name_at is not None and len(args) > name_at else None)
            recorder.add(phase, began, recorder.now(), timeline.COMM, tensor=name or "",
                         bytes=sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)))
            return result
        return timed  # type: ignore[return-value]
    return decorate


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


def resolve_op(average: Optional[bool], op: Optional[str]) -> str:
    if average is not None and op is not None:
        raise ValueError("allreduce: pass either average= (deprecated) or op=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op not in REDUCE_OPS and op != Adasum:
        raise ValueError(f"allreduce: op={op!r} is not known; use one of "
                         "Average, Sum, Min, Max, Product, Adasum")
    return op


def _averaged_and_scaled(result: torch.Tensor, reduced: torch.Tensor, *, op: str, is_float: bool,
                         postscale_factor: float, size: int) -> torch.Tensor:
    """A reduced sum as the op asks: divided by the ranks for Average, then postscaled (an integer
    Average takes one truncating scale by postscale/size, as Horovod's); in place where ``result`` is new."""
    if op == Average and not is_float:
        return scale(result, postscale_factor / size)
    if op == Average:
        result = result / size if result is not reduced else result.div_(size)
    if postscale_factor != 1.0:
        result = scale(result, postscale_factor)
    return result


def allreduce_start(tensor: torch.Tensor, out: Optional[torch.Tensor], op: str,
                     compression=Compression.none, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, blocking: bool = False,
                    path: Optional[str] = None, name: Optional[str] = None, checked: bool = False) -> Handle:
    """Start (or, with ``blocking``, run) one allreduce. ``path`` is how it travels: "new"
    (out-of-place straight into a new tensor), "blocking" or "async"; decided here from the
    call and recorded, so a joined rank replaying it takes the very same path. ``checked``:
    the ranks first agree on its arguments (every public call; DistributedOptimizer's buckets
    were agreed when it was built)."""
    b = _runtime.current()

    def recipe(way: str) -> Recipe:  # built once its path is known (dataclasses.replace costs ~10 us a call)
        return Recipe("allreduce", shape=tuple(tensor.shape), dtype=str(tensor.dtype), op=op,
                      compression=f"{compression.__module__}:{compression.__qualname__}", path=way,
                      prescale=prescale_factor, postscale=postscale_factor, name=name or "", checked=checked)

    if tensor.numel() == 0 or op == Adasum:
        return _allreduce_now(tensor, out, op, recipe("empty" if tensor.numel() == 0 else "adasum"), checked, name)
    work = tensor
    if prescale_factor != 1.0:
        work = scale(work, prescale_factor)
    compressed, ctx = compression.compress(work)
    wire = to_wire(compressed)
    if not wire.is_contiguous():
        wire = wire.contiguous()
    if path is None:
        path = "async" if not blocking else (
            "new" if out is None and compressed is tensor and b.out_of_place_applies(wire) else "blocking")
    seq = _runtime.enter(recipe(path))
    if checked:
        _checks.agree("allreduce", tensor, op, name=name)
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
        result = _averaged_and_scaled(result, reduced, op=op, is_float=is_float, postscale_factor=postscale_factor,
                                      size=size_)
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


def _allreduce_now(tensor: torch.Tensor, out: Optional[torch.Tensor], op: str, recipe: Recipe, checked: bool,
                   name: Optional[str]) -> Handle:
    """An allreduce of nothing, or an Adasum one (computed here, at once)."""
    if recipe.path == "adasum" and _runtime.in_subset():
        raise NotImplementedError("Adasum does not support non-global process sets yet (as in Horovod)")
    seq = _runtime.enter(recipe)
    if checked:
        _checks.agree("allreduce", tensor, op, name=name)
    if recipe.path == "empty":
        _runtime.completed(seq)
        return DoneHandle(out if out is not None else tensor.clone())
    # staged like every other op: MPI reads host memory, NCCL device memory (a joined
    # rank replays on CPU), gloo's point-to-point stages CUDA tensors itself
    result = adasum_allreduce(to_wire(tensor), _runtime.current()).to(device=tensor.device, dtype=tensor.dtype)
    _runtime.completed(seq)
    if out is not None:
        out.copy_(result)
        result = out
    return DoneHandle(result)


@timed("ALLREDUCE")
def allreduce_now(tensor: torch.Tensor, op: str, compression=Compression.none, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, name: Optional[str] = None) -> torch.Tensor:
    """A blocking out-of-place allreduce, without autograd."""
    return allreduce_start(tensor, None, op, compression, prescale_factor, postscale_factor,
                           blocking=True, name=name, checked=True).wait()


@timed("ALLREDUCE")
def grouped_allreduce_now(tensors: List[torch.Tensor], op: str, compression=Compression.none,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """Fused allreduce of several tensors (one per dtype and device), without autograd; every
    result is a tensor of its own (no shared buffer)."""
    if op == Adasum:
        return [allreduce_now(t, op) for t in tensors]
    results: List[Optional[torch.Tensor]] = [None] * len(tensors)
    by_dtype: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault((t.dtype, t.device), []).append(i)
    handles = []
    for idx in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        handles.append((idx, allreduce_start(flat, flat, op, compression, prescale_factor,
                                             postscale_factor, checked=True)))
    for idx, h in handles:
        flat = h.wait()
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            results[i] = flat[offset:offset + n].view_as(tensors[i]).clone() if len(idx) > 1 else \
                flat.view_as(tensors[i])
            offset += n
    return results  # type: ignore[return-value]


