"""Horovod's process sets: collectives among a subset of the ranks. Every rank registers a
set (``add_process_set``, collective over all ranks), then only its members call collectives
with ``process_set=``; the other ranks are not involved and not blocked.

>>> evens = sr.add_process_set([0, 2])  # doctest: +SKIP
>>> if evens.included():  # doctest: +SKIP
...     sr.allreduce(t, process_set=evens)
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Union

from . import _checks, _runtime, basics
from ._backend import Backend


class ProcessSet:
    """A subset of the ranks; ``process_set_id`` is set once it is registered.

    >>> ps = sr.ProcessSet([0, 1])  # doctest: +SKIP
    >>> sr.add_process_set(ps).size()  # doctest: +SKIP
    2
    """

    def __init__(self, ranks: Sequence[int]):
        self.ranks: List[int] = sorted(int(r) for r in ranks)
        self.process_set_id: Optional[int] = None
        self._backend: Optional[Backend] = None

    def _is_global(self) -> bool:
        return self is global_process_set

    def size(self) -> Optional[int]:
        """Number of ranks in the set (None before it is registered)."""
        if self._is_global():
            return basics.size()
        return len(self.ranks) if self.process_set_id is not None else None

    def rank(self) -> Optional[int]:
        """This process's rank within the set (None when it is not a member)."""
        if self._is_global():
            return basics.rank()
        return self.ranks.index(basics.rank()) if self.included() else None

    def included(self) -> Optional[bool]:
        """True when this process is a member (None before the set is registered)."""
        if self._is_global():
            return True
        if self.process_set_id is None:
            return None
        return basics.rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks or 'all'})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
_registered: Dict[int, ProcessSet] = {}
_next_id = [1]


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set; every rank must call it with the same ranks.

    Arguments:
        process_set: a ``sr.ProcessSet`` or a list of global ranks.

    Returns:
        The registered ``sr.ProcessSet`` (pass it as ``process_set=`` to a collective).

    >>> evens = sr.add_process_set([0, 2])  # doctest: +SKIP
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps._is_global():
        raise ValueError("add_process_set: the global process set is always registered")
    if ps.process_set_id is not None:
        raise ValueError(f"add_process_set: {ps} is registered already")
    size = basics.size()
    if not ps.ranks or len(set(ps.ranks)) != len(ps.ranks) or ps.ranks[0] < 0 or ps.ranks[-1] >= size:
        raise ValueError(f"add_process_set: ranks {ps.ranks} must be distinct ranks in 0..{size - 1}")
    if any(other.ranks == ps.ranks for other in _registered.values()):
        raise ValueError(f"add_process_set: a process set with ranks {ps.ranks} is registered already")
    _checks.agree("add_process_set")  # every rank is here (a mismatch raises on all, never hangs)
    everyone = _runtime.gather_objects(ps.ranks)
    for r, ranks in enumerate(everyone):
        if ranks != ps.ranks:
            raise ValueError(f"add_process_set: rank {r} registers ranks {ranks} but rank {basics.rank()} "
                             f"registers {ps.ranks}; every rank must add the same sets in the same order")
    ps._backend = _runtime.current().subgroup(ps.ranks)
    ps.process_set_id = _next_id[0]
    _next_id[0] += 1
    _registered[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank; False when it was not registered.

    Arguments:
        process_set: a set ``add_process_set`` returned.

    Returns:
        True when it was registered (and is no more), False otherwise.

    >>> sr.remove_process_set(evens)  # doctest: +SKIP
    True
    """
    if process_set._is_global():
        raise ValueError("remove_process_set: the global process set cannot be removed")
    if process_set.process_set_id not in _registered:
        return False
    _checks.agree("remove_process_set")  # every rank is done with it before its groups go
    del _registered[process_set.process_set_id]
    if process_set._backend is not None:
        process_set._backend.release()
    process_set._backend = None
    process_set.process_set_id = None
    return True


def forget_all() -> None:
    """A new ring (init after shutdown) starts with the global set only."""
    for ps in _registered.values():
        ps.process_set_id = None
        ps._backend = None
    _registered.clear()


def backend_of(process_set: Optional[ProcessSet]):
    """The backend a collective with ``process_set=`` runs on (None: the global ring)."""
    if process_set is None or process_set._is_global():
        return None
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered (add_process_set) or was removed")
    if process_set._backend is None:
        raise ValueError(f"rank {basics.rank()} is not in {process_set}: only its ranks call its collectives")
    return process_set._backend


def accepts_process_set(fn):
    """Give a collective Horovod's ``process_set=`` keyword."""

    @functools.wraps(fn)
    def wrapper(*args, process_set: Optional[ProcessSet] = None, **kwargs):
        backend = backend_of(process_set)
        if backend is None:
            return fn(*args, **kwargs)
        with _runtime.scope(backend):
            return fn(*args, **kwargs)

    return wrapper


_runtime.on_new_ring(lambda _backend: forget_all())
