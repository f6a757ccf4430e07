"""Runs a host ring's operations in order on one thread of their own, so an allreduce across hosts
(waiting on the network) goes on while backward computes the next gradients.

Written by hand because the order is the contract: every rank must run the ring's operations in the
same order, those started in the background and those called in the foreground alike (each one
numbers its generations on the shared segment). concurrent.futures' pool would keep the order with
one worker, but joins its threads at interpreter exit, where a rank whose peer is gone must not
wait; and a foreground call with nothing in flight should not pay a thread switch.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Tuple

Call = Tuple[Optional[Callable[..., Any]], Tuple[Any, ...], Optional[Future]]
STOP_WAIT_S = 10.0  # how long stop() waits for the call running on the worker

logger = logging.getLogger(__name__)


class RingWorker:
    """One daemon thread that runs the calls submitted to it, in order; a call made in the
    foreground runs after every call submitted before it. ``inline``: no thread, every call runs
    where it is made (``submit`` then says so with None).

    >>> worker = RingWorker("host ring")
    >>> started = worker.submit(sum, [1, 2])
    >>> worker.run(max, 3, 4), started.result()
    (4, 3)
    >>> worker.stop(timeout_s=1.0)
    True
    """

    def __init__(self, name: str, inline: bool = False):
        self._name, self.inline = name, inline
        self._queue: "queue.SimpleQueue[Call]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._thread: Optional[threading.Thread] = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Optional[Future]:
        """``fn(*args)`` on the worker, after everything submitted before it; its future (None
        inline: the caller runs it)."""
        if self.inline:
            return None
        future: Future = Future()
        with self._lock:
            self._in_flight += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put((fn, args, future))
        return future

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` after everything submitted before it: on this thread when nothing is in
        flight (nothing can be submitted meanwhile), else on the worker, waited for."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        with self._lock:
            if self._in_flight == 0:
                return fn(*args)
        future = self.submit(fn, *args)
        assert future is not None  # something is in flight: not inline
        return future.result()

    def stop(self, timeout_s: float = STOP_WAIT_S) -> bool:
        """Let the worker finish what was submitted and end; whether it ended within ``timeout_s``
        (a call waiting on a lost peer may still be running: the caller must then keep what it uses)."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return True
            self._queue.put((None, (), None))
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("%s: a call was still running after %.0f s at close", self._name, timeout_s)
        return not thread.is_alive()

    def _loop(self) -> None:
        while True:
            fn, args, future = self._queue.get()
            if fn is None or future is None:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - it reaches whoever waits on the future
                    future.set_exception(exc)
            with self._lock:
                self._in_flight -= 1
