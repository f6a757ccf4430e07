"""Tensor collectives of the Horovod API inside a rank: allreduce (and its async, in-place and
grouped forms), poll and synchronize, barrier and join (gather_ops has the others)."""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch

from ..errors import MismatchError
from . import _checks, _pending, _runtime, timeline
from ._adasum import adasum_allreduce
from ._backend import Handle
from ._handles import DoneHandle, PostHandle
from ._join import Recipe
from .compression import Compression
from .process_sets import ProcessSet, accepts_process_set, backend_of

Average = "Average"
Sum = "Sum"
Min = "Min"
Max = "Max"
Product = "Product"
Adasum = "Adasum"
REDUCE_OPS = {Sum: "sum", Average: "sum", Min: "min", Max: "max", Product: "product"}
_F = TypeVar("_F", bound=Callable[..., Any])


def _timed(phase: str) -> Callable[[_F], _F]:
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
        if not blocking:
            path = "async"
        elif out is None and compressed is tensor and b.out_of_place_applies(wire):
            path = "new"
        else:
            path = "blocking"
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
    op = resolve_op(average, op)
    return _pending.defer("allreduce", name, lambda: allreduce_start(
        tensor, None, op, compression, prescale_factor, postscale_factor, name=name, checked=True), "allreduce_async")


@accepts_process_set
def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[str] = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> Handle:
    """In-place variant of ``allreduce_async``.

    >>> h = sr.allreduce_async_(t); sr.synchronize(h)  # doctest: +SKIP
    """
    op = resolve_op(average, op)
    return _pending.defer("allreduce", name, lambda: allreduce_start(
        tensor, tensor, op, Compression.none, prescale_factor, postscale_factor, name=name, checked=True),
        "allreduce_async_")


@_timed("ALLREDUCE")
def allreduce_now(tensor: torch.Tensor, op: str, compression=Compression.none, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, name: Optional[str] = None) -> torch.Tensor:
    """A blocking out-of-place allreduce, without autograd."""
    return synchronize(allreduce_start(tensor, None, op, compression, prescale_factor, postscale_factor,
                                       blocking=True, name=name, checked=True))


@accepts_process_set
@_timed("ALLREDUCE")
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
    return synchronize(allreduce_start(tensor, tensor, resolve_op(average, op), Compression.none,
                                       prescale_factor, postscale_factor, blocking=True, name=name, checked=True))


@_timed("ALLREDUCE")
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
