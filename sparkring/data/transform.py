"""Runs a user's per-batch transformFn between the reader and the model: inline, or in a
pool of forked reader workers that keep a bounded number of batches ahead, in order.

torch's DataLoader would own the workers but wants a map- or iterable-style dataset it
splits itself; our reader already decides each rank's rows and order, so the pool only
maps a function over batches: multiprocessing.Pool does that, with the remote traceback
attached to the exception the training thread re-raises. Workers start as
sparkring.process_start decides (forked, or fresh where the rank holds a CUDA context; the
function travels pickled by value either way, so it need not be importable) and die with the
rank: forked ones inherit its sockets, and a worker outliving a failed rank would keep its
peers' connections open.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import signal
import sys
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, Mapping, Optional

import cloudpickle

from ..process_start import log_if_spawning, start_method

Batch = Dict[str, Any]
_worker_fn: Optional[Callable[[Batch], Batch]] = None


def apply(fn: Callable[[Batch], Batch], batch: Batch) -> Batch:
    """``fn(batch)``; what it returns replaces or adds to the batch's entries.

    >>> apply(lambda b: {"x": b["x"] * 2}, {"x": np.ones(2), "y": np.zeros(2)})["x"]  # doctest: +SKIP
    array([2., 2.])
    """
    out = fn(dict(batch))
    if not isinstance(out, Mapping):
        raise TypeError(f"transformFn returned {type(out).__name__}, not a dict: return a dict column -> array "
                        "(the entries it returns replace the batch's)")
    return {**batch, **out}


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            PR_SET_PDEATHSIG = 1
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:  # no libc by that name: the pool's terminate() still stops them
            pass


def _init_worker(fn_bytes: bytes) -> None:
    global _worker_fn
    _die_with_parent()
    try:
        import torch

        torch.set_num_threads(1)  # each worker is one of several decode processes
    except Exception:  # noqa: BLE001 - torch is optional for a transform
        pass
    _worker_fn = cloudpickle.loads(fn_bytes)


def _apply_in_worker(batch: Batch) -> Batch:
    assert _worker_fn is not None
    return apply(_worker_fn, batch)


def transformed(source: Iterator[Batch], fn: Callable[[Batch], Batch], workers: int,
                ahead: Optional[int] = None) -> Iterator[Batch]:
    """``apply(fn, batch)`` for each batch of ``source``, in order; with ``workers`` > 0 in
    that many worker processes, up to ``ahead`` batches (default 2 per worker) in flight.

    >>> for batch in transformed(reader, decode_png, workers=2):  # doctest: +SKIP
    ...     train_step(batch)
    """
    if workers <= 0:
        for batch in source:
            yield apply(fn, batch)
        return
    depth = max(1, ahead if ahead is not None else 2 * workers)
    start = start_method(uses_gpu=False)
    log_if_spawning(f"{workers} transformFn worker(s)", start)
    pool = multiprocessing.get_context(start.method).Pool(workers, initializer=_init_worker,
                                                    initargs=(cloudpickle.dumps(fn),))
    pending: Deque[Any] = deque()
    try:
        for batch in source:
            pending.append(pool.apply_async(_apply_in_worker, (batch,)))
            if len(pending) >= depth:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:
        pool.terminate()  # every result was taken, or the rank is failing: no work to keep
