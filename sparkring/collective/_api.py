"""Horovod-style collective operations for code running inside one rank."""
from __future__ import annotations

import atexit
import os
import threading
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

from . import _env
from ._backend import Backend, Handle
from .compression import Compression

Average = "Average"
Sum = "Sum"
Min = "Min"
Max = "Max"
Product = "Product"
Adasum = "Adasum"
_REDUCE_OPS = {Sum: "sum", Average: "sum", Min: "min", Max: "max", Product: "product"}


class NotInitializedError(RuntimeError):
    """A collective was called before ``init()`` (or after ``shutdown()``)."""


class _State:
    backend: Optional[Backend] = None
    local_rank = 0
    local_size = 1
    cross_rank = 0
    cross_size = 1
    joiner = None  # _join.Joiner when the ring has more than one rank
    lock = threading.Lock()


_state = _State()


def init(backend: Optional[str] = None) -> None:
    """Join the ring described by the runner's environment; idempotent.

    Without a runner (plain ``python train.py``) this forms a ring of one rank, so
    the same script runs alone.

    >>> import sparkring.collective as sr
    >>> sr.init(); sr.rank(), sr.size()
    (0, 1)
    """
    with _state.lock:
        if _state.backend is not None:
            return
        env = os.environ
        rank = int(env.get(_env.RANK, "0"))
        size = int(env.get(_env.SIZE, "1"))
        name = (backend or env.get(_env.BACKEND) or "auto").lower()
        if name == "auto":
            name = "nccl" if torch.cuda.is_available() and env.get("CUDA_VISIBLE_DEVICES") else "gloo"
        timeout = float(env.get(_env.TIMEOUT, "1800"))
        start_timeout = float(env.get(_env.START_TIMEOUT, timeout))  # rendezvous
        if name == "mpi":
            from ._mpi_backend import MPIBackend

            _state.backend = MPIBackend(rank, size, env.get(_env.MASTER_ADDR), env.get(_env.MASTER_PORT),
                                        start_timeout)
        elif name in ("gloo", "nccl"):
            from ._torch_backend import TorchBackend

            _state.backend = TorchBackend(name, rank, size, env.get(_env.MASTER_ADDR),
                                          env.get(_env.MASTER_PORT), timeout, start_timeout)
        else:
            raise ValueError(f"backend={name!r} is not known; use 'gloo', 'nccl', 'mpi' or 'auto'")
        _state.local_rank = int(env.get(_env.LOCAL_RANK, str(_state.backend.rank)))
        _state.local_size = int(env.get(_env.LOCAL_SIZE, str(_state.backend.size)))
        _state.cross_rank = int(env.get(_env.CROSS_RANK, "0"))
        _state.cross_size = int(env.get(_env.CROSS_SIZE, "1"))
        _checked_names.clear()
        stores = _state.backend.join_stores()
        if stores is not None:
            from ._join import Joiner

            _state.joiner = Joiner(_state.backend.rank, _state.backend.size, stores[0], stores[1],
                                   _replay)


def shutdown() -> None:
    """Leave the ring; a later ``init()`` joins again.

    >>> sr.shutdown(); sr.is_initialized()  # doctest: +SKIP
    False
    """
    with _state.lock:
        if _state.joiner is not None:
            _state.joiner.close()
            _state.joiner = None
        if _state.backend is not None:
            _state.backend.shutdown()
            _state.backend = None


atexit.register(shutdown)


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``.

    >>> sr.is_initialized()  # doctest: +SKIP
    True
    """
    return _state.backend is not None


def _in_a_run() -> bool:
    return _env.RANK in os.environ


def _b() -> Backend:
    """The backend; inside a sparkring run the first call joins the ring (lazy init, so code
    that sets up torch.distributed itself, the torchrun way, runs first and is reused)."""
    if _state.backend is None and _in_a_run():
        init()
    if _state.backend is None:
        raise NotInitializedError(
            "sparkring.collective is not initialized: call sparkring.collective.init() first "
            "(inside sparkring.run() the first collective call does it)")
    return _state.backend


def _enter(kind: str, **meta) -> int:
    """Number this collective (and keep how to replay it) for ranks that join()."""
    joiner = _state.joiner
    return joiner.enter(kind, meta) if joiner is not None else -1


def _completed(seq: int) -> None:
    joiner = _state.joiner
    if joiner is not None and seq >= 0:
        joiner.completed(seq)


def rank() -> int:
    """This process's rank, 0..size()-1.

    >>> sr.rank()  # doctest: +SKIP
    0
    """
    return _b().rank


def size() -> int:
    """Number of ranks in the ring.

    >>> sr.size()  # doctest: +SKIP
    2
    """
    return _b().size


def local_rank() -> int:
    """Rank among the ranks on this host (use it to pick a GPU).

    >>> sr.local_rank()  # doctest: +SKIP
    0
    """
    _b()
    return _state.local_rank


def local_size() -> int:
    """Number of ranks on this host.

    >>> sr.local_size()  # doctest: +SKIP
    2
    """
    _b()
    return _state.local_size


def cross_rank() -> int:
    """Index of this host among the hosts of the ring.

    >>> sr.cross_rank()  # doctest: +SKIP
    0
    """
    _b()
    return _state.cross_rank


def cross_size() -> int:
    """Number of hosts in the ring.

    >>> sr.cross_size()  # doctest: +SKIP
    1
    """
    _b()
    return _state.cross_size


def backend() -> str:
    """Name of the transport in use: "gloo", "nccl" or "mpi".

    >>> sr.backend()  # doctest: +SKIP
    'gloo'
    """
    return _b().name


# -- tensors ---------------------------------------------------------------------------

def _to_wire(tensor: torch.Tensor) -> torch.Tensor:
    dev = _b().device
    if dev is not None and tensor.device != dev:
        return tensor.to(dev)
    return tensor


class _PostHandle(Handle):
    """A backend handle plus what to do with its result: scale, decompress, copy out."""

    def __init__(self, inner: Handle, finish):
        self._inner = inner
        self._finish = finish
        self._result: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._finish(self._inner.wait())
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None or self._inner.is_completed()


class _DoneHandle(Handle):
    def __init__(self, result: torch.Tensor):
        self._result = result

    def wait(self):
        return self._result

    def is_completed(self):
        return True


def _resolve_op(average: Optional[bool], op: Optional[str]) -> str:
    if average is not None and op is not None:
        raise ValueError("allreduce: pass either average= (deprecated) or op=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op not in _REDUCE_OPS and op != Adasum:
        raise ValueError(f"allreduce: op={op!r} is not known; use one of "
                         "Average, Sum, Min, Max, Product, Adasum")
    return op


def _allreduce_async(tensor: torch.Tensor, out: Optional[torch.Tensor], op: str,
                     compression=Compression.none, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, blocking: bool = False,
                     path: Optional[str] = None) -> Handle:
    """Start (or, with ``blocking``, run) one allreduce. ``path`` is how it travels: "new"
    (out-of-place straight into a new tensor), "blocking" or "async"; decided here from the
    call and recorded, so a joined rank replaying it takes the very same path."""
    b = _b()
    if tensor.numel() == 0:
        result = out if out is not None else tensor.clone()
        return _DoneHandle(result)
    recipe = dict(shape=list(tensor.shape), dtype=str(tensor.dtype), op=op,
                  compression=f"{compression.__module__}:{compression.__qualname__}",
                  prescale=prescale_factor, postscale=postscale_factor)
    if op == Adasum:
        seq = _enter("allreduce", path="adasum", **recipe)
        from ._adasum import adasum_allreduce

        result = adasum_allreduce(tensor, b)
        _completed(seq)
        if out is not None:
            out.copy_(result)
            result = out
        return _DoneHandle(result)
    work = tensor
    if prescale_factor != 1.0:
        work = work * prescale_factor
    compressed, ctx = compression.compress(work)
    wire = _to_wire(compressed)
    if not wire.is_contiguous():
        wire = wire.contiguous()
    if path is None:
        if not blocking:
            path = "async"
        elif out is None and compressed is tensor and b.out_of_place_applies(wire):
            path = "new"
        else:
            path = "blocking"
    seq = _enter("allreduce", path=path, **recipe)
    if wire is tensor and path != "new" and out is not tensor:  # never reduce into the caller's tensor
        wire = b.result_like(tensor).copy_(tensor)
    size_ = b.size
    is_float = tensor.dtype.is_floating_point or tensor.dtype.is_complex

    def finish(reduced: torch.Tensor) -> torch.Tensor:
        _completed(seq)
        result = compression.decompress(reduced, ctx)
        if result.device != tensor.device:
            result = result.to(tensor.device)
        if op == Average:
            if is_float:
                result = result / size_ if result is not reduced else result.div_(size_)
            else:
                result = torch.div(result, size_, rounding_mode="floor")
        if postscale_factor != 1.0:
            result = result * postscale_factor
        if out is not None:
            if result is not out:
                out.copy_(result)
            return out
        return result

    if path == "new":
        return _DoneHandle(finish(b.allreduce_new(wire, _REDUCE_OPS[op])))
    if path == "blocking":
        return _DoneHandle(finish(b.allreduce(wire, _REDUCE_OPS[op])))
    return _PostHandle(b.allreduce_async(wire, _REDUCE_OPS[op]), finish)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[str] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, compression=Compression.none) -> Handle:
    """Start an allreduce; ``synchronize(handle)`` returns the result.

    >>> h = sr.allreduce_async(torch.ones(3)); sr.synchronize(h)  # doctest: +SKIP
    tensor([1., 1., 1.])
    """
    _check_name(name, tensor, "allreduce")
    return _allreduce_async(tensor, None, _resolve_op(average, op), compression,
                            prescale_factor, postscale_factor)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[str] = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> Handle:
    """In-place variant of ``allreduce_async``.

    >>> h = sr.allreduce_async_(t); sr.synchronize(h)  # doctest: +SKIP
    """
    _check_name(name, tensor, "allreduce")
    return _allreduce_async(tensor, tensor, _resolve_op(average, op), Compression.none,
                            prescale_factor, postscale_factor)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression=Compression.none, op: Optional[str] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (default: average) and return a new tensor.

    >>> sr.allreduce(torch.tensor([float(sr.rank())]))  # 2 ranks  # doctest: +SKIP
    tensor([0.5000])
    """
    _check_name(name, tensor, "allreduce")
    return synchronize(_allreduce_async(tensor, None, _resolve_op(average, op), compression,
                                        prescale_factor, postscale_factor, blocking=True))


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[str] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place and return it.

    >>> t = torch.ones(2); sr.allreduce_(t, op=sr.Sum)  # doctest: +SKIP
    """
    _check_name(name, tensor, "allreduce")
    return synchronize(_allreduce_async(tensor, tensor, _resolve_op(average, op),
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
        handles.append((idx, _allreduce_async(flat, flat, op, compression, prescale_factor,
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
    b = _b()
    t = tensor if tensor.dim() > 0 else tensor.reshape(1)
    seq = _enter("allgather", tail=list(t.shape[1:]), dtype=str(t.dtype))
    wire = _to_wire(t.contiguous())
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
        pad = torch.zeros((biggest - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype,
                          device=wire.device)
        wire = torch.cat([wire, pad])
    parts = b.allgather_same_shape(wire)
    _completed(seq)
    out = torch.cat([p[:n] for p, n in zip(parts, firsts)])
    return out.to(tensor.device)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Start an in-place broadcast from ``root_rank``.

    >>> sr.synchronize(sr.broadcast_async_(t, 0))  # doctest: +SKIP
    """
    _check_name(name, tensor, "broadcast")
    wire = _to_wire(tensor)
    if tensor.numel() == 0:
        return _DoneHandle(tensor)
    _enter("broadcast", shape=list(tensor.shape), dtype=str(tensor.dtype), root=root_rank)
    inner = _b().broadcast_async(wire, root_rank)
    if wire is tensor:
        return inner

    def finish(result):
        tensor.copy_(result)
        return tensor

    return _PostHandle(inner, finish)


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


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None) -> Any:
    """Return root's (picklable) object on every rank.

    >>> sr.broadcast_object({"epoch": 3}, root_rank=0)  # doctest: +SKIP
    {'epoch': 3}
    """
    b = _b()
    _enter("broadcast_object", root=root_rank)
    return b.broadcast_object(obj, root_rank)


def allgather_object(obj: Any, name: Optional[str] = None) -> List[Any]:
    """Return the list of every rank's (picklable) object, by rank.

    >>> sr.allgather_object(sr.rank())  # doctest: +SKIP
    [0, 1]
    """
    b = _b()
    seq = _enter("allgather_object")
    out = b.allgather_object(obj)
    _completed(seq)
    return out


def barrier() -> None:
    """Block until every rank reaches this call.

    >>> sr.barrier()  # doctest: +SKIP
    """
    b = _b()
    seq = _enter("barrier")
    b.barrier()
    _completed(seq)


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
    b = _b()
    joiner = _state.joiner
    return b.rank if joiner is None else joiner.join()


def _neutral(shape: List[int], dtype: torch.dtype, op: str) -> torch.Tensor:
    """What a joined rank contributes to an allreduce: the identity of ``op``."""
    if op in (Min, Max):
        if dtype == torch.bool:
            value: Any = op == Min
        elif dtype.is_floating_point:
            value = float("inf") if op == Min else float("-inf")
        else:
            info = torch.iinfo(dtype)
            value = info.max if op == Min else info.min
    else:
        value = 1 if op == Product else 0
    return torch.full(shape, value, dtype=dtype)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.split(".")[-1])


def _replay(recipe: Dict[str, Any]) -> None:
    """Run, on a joined rank, the collective the active ranks are running."""
    import importlib

    kind = recipe["kind"]
    me = _b().rank
    if kind == "allreduce":
        module, _, qualname = recipe["compression"].partition(":")
        compression = importlib.import_module(module)
        for part in qualname.split("."):
            compression = getattr(compression, part)
        tensor = _neutral(recipe["shape"], _dtype(recipe["dtype"]), recipe["op"])
        # the path the active ranks took, so every rank runs matching transfers
        _allreduce_async(tensor, None, recipe["op"], compression, recipe["prescale"], recipe["postscale"],
                         path=recipe["path"]).wait()
    elif kind == "allgather":
        allgather(torch.empty([0] + recipe["tail"], dtype=_dtype(recipe["dtype"])))
    elif kind == "alltoall":
        alltoall(torch.empty([0] + recipe["tail"], dtype=_dtype(recipe["dtype"])),
                 splits=[0] * _b().size)
    elif kind in ("broadcast", "broadcast_object"):
        if recipe["root"] == me:
            raise RuntimeError(
                f"rank {me} called join() but the other ranks then started a {kind} from root "
                f"rank {me}; a rank that has joined has no data to send. Broadcast from a rank "
                "that has not joined, or before the first rank joins")
        if kind == "broadcast":
            broadcast_async_(torch.empty(recipe["shape"], dtype=_dtype(recipe["dtype"])),
                             recipe["root"]).wait()
        else:
            broadcast_object(None, recipe["root"])
    elif kind == "allgather_object":
        allgather_object(None)
    elif kind == "barrier":
        barrier()
    else:  # a newer peer: fail loudly rather than hang
        raise RuntimeError(f"join(): rank {me} cannot take part in a {kind!r} collective")


def alltoall(tensor: torch.Tensor, splits: Optional[Union[List[int], torch.Tensor]] = None,
             name: Optional[str] = None) -> torch.Tensor:
    """Scatter slices of ``tensor`` (dim 0, by ``splits``) to every rank and gather what
    they send back, concatenated by source rank.

    >>> sr.alltoall(torch.arange(4))  # 2 ranks: rank 0 gets [0, 1] + rank 1's [0, 1]  # doctest: +SKIP
    """
    b = _b()
    n = tensor.shape[0]
    if splits is None:
        if n % b.size:
            raise ValueError(f"alltoall: dim 0 of size {n} does not split evenly over {b.size} "
                             "ranks; pass splits=")
        splits = [n // b.size] * b.size
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != b.size or sum(splits) != n:
        raise ValueError(f"alltoall: splits {splits} must have {b.size} entries summing to {n}")
    seq = _enter("alltoall", tail=list(tensor.shape[1:]), dtype=str(tensor.dtype))
    wire = _to_wire(tensor.contiguous())
    send_counts = torch.tensor(splits, dtype=torch.int64)
    recv_counts = [int(row[b.rank]) for row in b.allgather_same_shape(_to_wire(send_counts))]
    inputs = list(torch.split(wire, splits))
    tail = tuple(tensor.shape[1:])
    outputs = [torch.empty((c,) + tail, dtype=tensor.dtype, device=wire.device) for c in recv_counts]
    b.alltoall(outputs, inputs)
    _completed(seq)
    return torch.cat(outputs).to(tensor.device)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression=Compression.none,
                  op: str = Average) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return this rank's slice of dim 0 (the first
    ranks get one row more when it does not divide evenly, as in Horovod).

    >>> sr.reducescatter(torch.ones(4, 2))  # 2 ranks: a (2, 2) tensor of ones  # doctest: +SKIP
    """
    b = _b()
    reduced = allreduce(tensor, op=op, compression=compression)
    n = tensor.shape[0]
    base, extra = divmod(n, b.size)
    start = b.rank * base + min(b.rank, extra)
    return reduced[start:start + base + (1 if b.rank < extra else 0)].clone()


# -- model state -----------------------------------------------------------------------

def broadcast_parameters(params: Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]],
                         root_rank: int = 0) -> None:
    """Copy root's parameters/buffers into every rank's, in place.

    Accepts ``model.state_dict()`` or ``model.named_parameters()``.

    >>> sr.broadcast_parameters(model.state_dict(), root_rank=0)  # doctest: +SKIP
    """
    items = sorted(params.items()) if isinstance(params, Mapping) else sorted(params, key=lambda kv: kv[0])
    handles = []
    for _, p in items:
        if not isinstance(p, torch.Tensor):
            raise TypeError("broadcast_parameters expects tensors; got " + type(p).__name__)
        target = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(broadcast_async_(target, root_rank))
    for h in handles:
        h.wait()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every rank's optimizer state (tensors, step counters, lr and other
    hyperparameters) equal to root's.

    >>> sr.broadcast_optimizer_state(opt, root_rank=0)  # doctest: +SKIP
    """
    state = optimizer.state_dict()
    # Tensors travel as tensors (cheap for big moments); everything else as one object.
    tensors: List[Tuple[Tuple, torch.Tensor]] = []
    skeleton: Dict[str, Any] = {"param_groups": state["param_groups"], "state": {}}
    for pid, pstate in state["state"].items():
        entry = {}
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor):
                tensors.append(((pid, key), value))
                entry[key] = ("__tensor__", tuple(value.shape), str(value.dtype))
            else:
                entry[key] = value
        skeleton["state"][pid] = entry
    root_skeleton = broadcast_object(skeleton, root_rank)
    root_keys = [(pid, key) for pid, e in root_skeleton["state"].items() for key, v in e.items()
                 if isinstance(v, tuple) and v and v[0] == "__tensor__"]
    local = dict(tensors)
    new_state: Dict[Any, Dict[str, Any]] = {}
    handles = []
    for pid, entry in root_skeleton["state"].items():
        new_state[pid] = {}
        for key, value in entry.items():
            if (pid, key) in root_keys:
                _, shape, dtype = value
                buf = local.get((pid, key))
                if buf is None or tuple(buf.shape) != shape or str(buf.dtype) != dtype:
                    buf = torch.zeros(shape, dtype=getattr(torch, dtype.split(".")[-1]))
                else:
                    buf = buf.clone()
                handles.append(broadcast_async_(buf, root_rank))
                new_state[pid][key] = buf
            else:
                new_state[pid][key] = value
    for h in handles:
        h.wait()
    optimizer.load_state_dict({"state": new_state, "param_groups": root_skeleton["param_groups"]})


# -- what is built (Horovod's introspection calls) -----------------------------------------

def gloo_built() -> bool:
    """True: gloo (CPU) collectives are available.

    >>> sr.gloo_built()
    True
    """
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def nccl_built() -> bool:
    """True when this torch build has NCCL (GPU) collectives.

    >>> sr.nccl_built()  # doctest: +SKIP
    False
    """
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def mpi_built() -> bool:
    """True when mpi4py (and so the ``backend="mpi"`` transport) is installed.

    >>> sr.mpi_built()  # doctest: +SKIP
    True
    """
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def mpi_threads_supported() -> bool:
    """True when this ring runs on MPI and the MPI library takes calls from several
    threads at once (MPI_THREAD_MULTIPLE); False on gloo/nccl (MPI is never initialized
    just to answer).

    >>> sr.mpi_threads_supported()  # doctest: +SKIP
    True
    """
    if _state.backend is None or _state.backend.name != "mpi":
        return False
    from ._mpi_backend import threads_supported

    return threads_supported()


_checked_names: Dict[str, Tuple] = {}


def check_same_shapes(named: List[Tuple[str, torch.Tensor]], what: str) -> None:
    """Raise ValueError naming the rank and tensor when ranks disagree on names, shapes or dtypes.

    >>> sr.check_same_shapes(list(model.named_parameters()), "DistributedOptimizer")  # doctest: +SKIP
    """
    b = _b()
    if b.size == 1:
        return
    mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
    everyone = allgather_object(mine)
    for r, theirs in enumerate(everyone):
        if theirs == mine or theirs is None:  # None: a rank that join()ed sends nothing
            continue
        mine_d = {n: (s, d) for n, s, d in mine}
        theirs_d = {n: (s, d) for n, s, d in theirs}
        for n in sorted(set(mine_d) | set(theirs_d)):
            if mine_d.get(n) != theirs_d.get(n):
                raise ValueError(
                    f"{what}: tensor {n!r} is {_describe(theirs_d.get(n))} on rank {r} but "
                    f"{_describe(mine_d.get(n))} on rank {b.rank}; every rank must pass the same "
                    "names with the same shapes and dtypes")
        raise ValueError(f"{what}: rank {r} passes tensors in a different order than rank {b.rank}")


def _describe(entry) -> str:
    return "missing" if entry is None else f"shape {entry[0]} {entry[1]}"


def _check_name(name: Optional[str], tensor: torch.Tensor, what: str) -> None:
    """First use of a name: every rank must agree on its shape (Horovod checks this too)."""
    if name is None or _b().size == 1:
        return
    sig = (tuple(tensor.shape), str(tensor.dtype))
    if _checked_names.get(name) == sig:
        return
    check_same_shapes([(name, tensor)], what)
    _checked_names[name] = sig
