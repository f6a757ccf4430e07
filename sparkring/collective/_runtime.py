"""The ring's lifecycle inside one rank: joining it (the backend chosen through one registry) and leaving
it, the host layout it was given, the process set a collective runs in; basics holds the public calls."""
from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from ..errors import NotInitializedError
from . import environment, timeline
from ._backend import Backend
from ._join import Joiner, Recipe
from .ports import free_ports


class _State:
    backend: Optional[Backend] = None
    generation = 0                    # how many rings this process has left
    next_port: Optional[str] = None   # where the next ring meets (agreed when the last one ended)
    local_rank = 0
    local_size = 1
    cross_rank = 0
    cross_size = 1
    joiner: Optional[Joiner] = None  # when the ring has more than one rank
    lock = threading.Lock()


state = _State()
_scope = threading.local()  # the process set a collective runs in (unset: every rank)


def _torch_distributed(name: str, rank: int, size: int, master_addr: Optional[str], master_port: Optional[str],
                       timeout: float, start_timeout: float) -> Backend:
    from ._torch_backend import TorchBackend

    return TorchBackend(name, rank, size, master_addr, master_port, timeout, start_timeout)


def _mpi(name: str, rank: int, size: int, master_addr: Optional[str], master_port: Optional[str],
         timeout: float, start_timeout: float) -> Backend:
    from ._mpi_backend import MPIBackend  # mpi4py loads only when asked for

    return MPIBackend(rank, size, master_addr, master_port, start_timeout)


# The one list of transports: name -> factory(name, rank, size, master_addr, master_port,
# timeout, start_timeout). The runner's backend choices and init() both read it.
BACKENDS: Dict[str, Callable[..., Backend]] = {"gloo": _torch_distributed, "nccl": _torch_distributed, "mpi": _mpi}


def join_ring(backend: Optional[str] = None) -> None:
    """Join the ring the runner's environment describes (basics.init is the public call)."""
    with state.lock:
        if state.backend is not None:
            return
        place = environment.RankEnv.from_env()
        name = (backend or place.backend).lower()
        if name == "auto":  # a script run on its own; under the runner the driver decided
            name = "nccl" if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES") else "gloo"
        if place.gpu is not None and torch.cuda.is_available():
            # the runner gives every rank of a host the same CUDA_VISIBLE_DEVICES, ordered by
            # local rank: this is the rank's own GPU (what set_device(local_rank) picks too)
            torch.cuda.set_device(environment.rank_device())
        factory = BACKENDS.get(name)
        if factory is None:
            raise ValueError(f"backend={name!r} is not known; use one of {', '.join(sorted(BACKENDS))} or 'auto'")
        port = state.next_port or (str(place.master_port) if place.master_port is not None else None)
        began = time.time() * 1e6
        state.backend = factory(name, place.rank, place.size, place.master_addr, port, place.collective_timeout,
                                place.rendezvous_timeout)
        state.local_rank = state.backend.rank if place.local_rank is None else place.local_rank
        state.local_size = state.backend.size if place.local_size is None else place.local_size
        state.cross_rank, state.cross_size = place.cross_rank, place.cross_size
        for hook in _new_ring_hooks:
            hook(state.backend)
        timeline.recorder.joined_us = (began, time.time() * 1e6)


# What the modules above this one reset or start for each new ring (names in flight, process
# sets, the join watcher): they register here, so the ring's lifecycle imports none of them.
_new_ring_hooks: List[Callable[[Backend], None]] = []


def on_new_ring(hook: Callable[[Backend], None]) -> None:
    """Call ``hook(backend)`` each time this process joins a ring, before any collective.

    >>> on_new_ring(lambda backend: print(backend.size))  # doctest: +SKIP
    """
    _new_ring_hooks.append(hook)


def gather_objects(obj: Any) -> List[Any]:
    """Every rank's object, unchecked: for the collective's own agreements (argument checks,
    process sets), below the public, checked ``allgather_object``. A joined rank sends None."""
    seq = enter(Recipe("gather_objects"))
    out = current().allgather_object(obj)
    completed(seq)
    return out


def leave_ring() -> None:
    """Leave the ring, handing the next one its port (basics.shutdown is the public call)."""
    _leave(hand_over=True)


def _leave(hand_over: bool) -> None:
    with state.lock:
        if state.joiner is not None:
            state.joiner.close()
            state.joiner = None
        if state.backend is not None:
            # without the peer that went away no ring of these ranks forms again, and rank 0
            # would wait for it to read the next port
            if hand_over and not state.backend.peer_lost():
                _agree_next_port(state.backend)
            state.backend.shutdown()
            state.backend = None


def _agree_next_port(backend: Backend) -> None:
    """Before the store goes away, rank 0 names a fresh port for the next ring and waits
    until every rank has read it: a rank that re-inits quickly must never meet the old
    store, nor rank 0 bind a port its old store still holds."""
    import datetime
    import time

    store = backend.rendezvous()
    addr = environment.RankEnv.from_env().master_addr
    if store is None or not addr:
        return
    prefix = f"sparkring/ring{state.generation}/"
    try:
        store.set_timeout(datetime.timedelta(seconds=10))
        if backend.rank == 0:
            store.set(prefix + "next_port", str(free_ports(addr)[0]))
        port = store.get(prefix + "next_port").decode()
        read = store.add(prefix + "read", 1)
        deadline = time.monotonic() + 10
        while backend.rank == 0 and read < backend.size and time.monotonic() < deadline:
            time.sleep(0.002)
            read = store.add(prefix + "read", 0)
        state.next_port = port
        state.generation += 1
    except Exception:  # noqa: BLE001 - a peer already gone: the process is ending, no next ring
        state.next_port = None


def close() -> None:
    """Leave the ring for good (the process is ending): no hand-over to a next ring."""
    _leave(hand_over=False)


atexit.register(close)


def initialized() -> bool:
    return state.backend is not None


def current() -> Backend:
    """The backend of the ring (or of the process set a collective runs in); inside a
    sparkring run the first call joins the ring (lazy init, so code that sets up
    torch.distributed itself, the torchrun way, runs first and is reused)."""
    sub = getattr(_scope, "backend", None)
    if sub is not None:
        return sub
    if state.backend is None and environment.in_a_run():
        join_ring()
    if state.backend is None:
        raise NotInitializedError(
            "sparkring.collective is not initialized: call sparkring.collective.init() first "
            "(inside sparkring.run() the first collective call does it)")
    return state.backend


class scope:
    """Run the collectives of a ``with`` block in a process set's ring (its backend).

    >>> with scope(backend_of_set):  # doctest: +SKIP
    ...     mpi_ops.allreduce(t)
    """

    def __init__(self, backend: Optional[Backend]):
        self.backend = backend

    def __enter__(self):
        self.previous = getattr(_scope, "backend", None)
        _scope.backend = self.backend
        return self

    def __exit__(self, *exc):
        _scope.backend = self.previous


def active_set_backend() -> Optional[Backend]:
    """The process set backend collectives run on now (None: the global ring)."""
    return getattr(_scope, "backend", None)


def global_rank() -> int:
    """This process's rank in the global ring, also inside a process set."""
    current()  # raises NotInitializedError before init()
    backend = state.backend
    assert backend is not None
    return backend.rank


def in_subset() -> bool:
    """True while a collective runs in a process set other than the global one."""
    return getattr(_scope, "backend", None) is not None


def enter(recipe: Recipe) -> int:
    """Number this collective (and keep how to replay it) for ranks that join(); join() is
    about the global ring, so collectives of a process set are not numbered."""
    joiner = state.joiner
    return joiner.enter(recipe) if joiner is not None and not in_subset() else -1


def completed(seq: int) -> None:
    joiner = state.joiner
    if joiner is not None and seq >= 0:
        joiner.completed(seq)
