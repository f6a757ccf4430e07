"""Horovod's asynchronous collectives, negotiated: an ``*_async`` call queues its operation, and
ranks run the operations that *every* rank has queued (matched by name, unnamed ones by their
order), in rank 0's order, when they next meet: in a checked collective or in synchronize().
So ranks may issue async operations in different orders, as Horovod's coordinator allows,
``poll()`` says False until an operation ran, and a name in flight twice is refused.

An operation runs when the ranks meet; ``poll()`` alone never starts it (``synchronize()`` or
any other collective does). Where ranks wait for each other with nothing every rank queued (a
rank waits for an operation another never started), every rank raises MismatchError naming
what each waits for, instead of hanging.

Written by hand: torch.distributed runs collectives in the order each rank issues them, and
Horovod's negotiation lives in its C++ core."""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _runtime, basics
from ._backend import Backend, Handle


@dataclasses.dataclass
class PendingOp:
    """One queued operation: ``start()`` runs it on every rank at once (a Handle or a result)."""

    key: str                          # what ranks match it by: its name, or "<kind>.noname.<n>"
    kind: str
    start: Callable[[], Any]
    scope: Optional[Backend]          # the process set's backend (None: the global ring)
    outcome: Any = None
    error: Optional[BaseException] = None
    started: bool = False
    handle: Optional[Handle] = None   # what the caller holds (its name is in flight until the op runs)


class DeferredHandle(Handle):
    """The handle of a queued operation: completed once it ran (and its transfer ended)."""

    def __init__(self, op: PendingOp):
        self.op = op
        op.handle = self

    def is_completed(self) -> bool:
        if not self.op.started:
            return False
        outcome = self.op.outcome
        return self.op.error is not None or not isinstance(outcome, Handle) or outcome.is_completed()

    def wait(self) -> Any:
        if not self.op.started:
            raise RuntimeError(f"{self.op.kind} {self.op.key!r} has not run yet: synchronize() runs it")
        if self.op.error is not None:
            raise self.op.error
        outcome = self.op.outcome
        return outcome.wait() if isinstance(outcome, Handle) else outcome


class _Queue:
    def __init__(self) -> None:
        self.ops: List[PendingOp] = []
        self.unnamed = 0

    def take(self, key: str) -> PendingOp:
        for i, op in enumerate(self.ops):
            if op.key == key:
                return self.ops.pop(i)
        raise KeyError(key)


_queues: Dict[Backend, _Queue] = {}
in_flight: Dict[str, Handle] = {}     # names of operations not run (or not synchronized) yet
_local = threading.local()


def negotiating() -> bool:
    """True while this thread runs the operations a round agreed on (they do not negotiate)."""
    return getattr(_local, "negotiating", False)


def count(backend: Backend) -> int:
    queue = _queues.get(backend)
    return len(queue.ops) if queue is not None else 0


def hold_name(name: Optional[str], handle: Handle, what: str) -> None:
    """Horovod refuses a second operation in flight under the same name."""
    if name is None:
        return
    if name in in_flight:
        raise ValueError(f"{what}: an operation named {name!r} is still in flight on rank "
                         f"{basics.rank()}; synchronize() it before reusing the name")
    in_flight[name] = handle


def release(handle: Handle) -> None:
    for name in [n for n, h in in_flight.items() if h is handle]:
        del in_flight[name]


def defer(kind: str, name: Optional[str], start: Callable[[], Any], what: str) -> DeferredHandle:
    """Queue an operation for every rank to run once all have queued it.

    >>> handle = defer("allreduce", "grad.0", lambda: allreduce_start(...), "allreduce_async")  # doctest: +SKIP
    """
    backend = _runtime.current()
    queue = _queues.setdefault(backend, _Queue())
    key = name if name is not None else f"{kind}.noname.{queue.unnamed}"
    if name is None:
        queue.unnamed += 1
    op = PendingOp(key=key, kind=kind, start=start, scope=_runtime.active_set_backend())
    handle = DeferredHandle(op)
    hold_name(name, handle, what)
    if backend.size == 1 or negotiating():
        _run(op)  # nothing to negotiate
    else:
        queue.ops.append(op)
    return handle


def _run(op: PendingOp) -> None:
    op.started = True
    if op.handle is not None:
        release(op.handle)
    try:
        with _runtime.scope(op.scope):
            op.outcome = op.start()
    except Exception as exc:  # noqa: BLE001 - it belongs to the handle: synchronize() raises it
        op.error = exc


def abandon(op: PendingOp, error: BaseException) -> None:
    """Drop a queued operation whose synchronize() failed (no other rank started it)."""
    queue = _queues.get(_runtime.current())
    if queue is not None and op in queue.ops:
        queue.ops.remove(op)
    op.started, op.error = True, error
    if op.handle is not None:
        release(op.handle)


def run_round(backend: Backend, joined: bool, waiting_for: str) -> Tuple[bool, List[Dict[str, Any]]]:
    """One negotiation among the ranks of ``backend`` (all of them call it): run, in rank 0's
    order, the queued operations every active rank has; whether any ran, and what each rank
    said (its queue, what it waits for)."""
    queue = _queues.setdefault(backend, _Queue())
    mine = {"pending": [op.key for op in queue.ops] if not joined else [], "joined": joined, "at": waiting_for}
    everyone = backend.allgather_object(mine)
    active = [said for said in everyone if not said["joined"]]
    common = [key for key in (active[0]["pending"] if active else [])
              if all(key in said["pending"] for said in active[1:])]
    if not common or joined:  # a joined rank replays the operations as the others run them
        return bool(common), everyone
    ops = [queue.take(key) for key in common]
    with _negotiating():
        for op in ops:
            _run(op)
    return True, everyone


@contextlib.contextmanager
def _negotiating():
    _local.negotiating = True
    try:
        yield
    finally:
        _local.negotiating = False


def stuck_message(everyone: List[Dict[str, Any]]) -> str:
    """Why the ranks cannot go on: what each waits for, and what each has queued."""
    lines = [f"rank {r} waits in {said['at']}" + (f" with {', '.join(repr(k) for k in said['pending'])} queued"
                                                   if said["pending"] else "")
             for r, said in enumerate(everyone)]
    return ("the ranks wait for each other with no operation queued on every rank, so none can go on: "
            + "; ".join(lines) + ". Every rank must start the same operations (the same names); the order "
            "of async operations may differ")


def forget() -> None:
    """A new ring starts with nothing queued and no name in flight."""
    _queues.clear()
    in_flight.clear()


_runtime.on_new_ring(lambda _backend: forget())
