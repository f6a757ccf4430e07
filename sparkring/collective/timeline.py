"""A rank's timeline: spans of what it did (start-up, data wait, forward, backward, each
gradient allreduce with its bytes, optimizer step, checkpoint), recorded in memory while
``start()`` is on and handed over as Chrome-trace events (Perfetto, chrome://tracing) for the
driver to merge. Written by hand: torch.profiler traces operators, not a run's phases across
ranks, and costs far more per step; this records a tuple per span."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

from . import environment

COMPUTE, COMM = 0, 1  # thread ids of the trace: the training thread, the gradient exchanges
EVENTS_KEY = "sparkring_timeline"  # a rank's spans, sent to run()'s driver as its last event


class Timeline:
    """Spans of one rank, in wall-clock microseconds (ranks of a host share the clock).

    >>> tl = Timeline()
    >>> tl.start(rank=0)
    >>> with tl.span("forward"):
    ...     pass
    >>> [e["name"] for e in tl.events() if e["ph"] == "X"]
    ['forward']
    """

    def __init__(self) -> None:
        self.on = False
        self.rank = 0
        self._spans: List[tuple] = []
        self._lock = threading.Lock()
        self.joined_us = (0.0, 0.0)  # when this process began and finished joining its last ring
        self.user_code_began = 0.0   # run(): when the user's function started

    def start(self, rank: int) -> None:
        """Record spans from now on, as rank ``rank``."""
        self.on, self.rank = True, rank
        self._spans = []

    def stop(self) -> None:
        """Stop recording."""
        self.on = False

    @staticmethod
    def now() -> float:
        """Microseconds since the epoch: the timeline's clock."""
        return time.time() * 1e6

    def add(self, name: str, begin_us: float, end_us: float, tid: int = COMPUTE, **args: Any) -> None:
        """A finished span (``begin_us``/``end_us`` from ``now()``)."""
        if self.on:
            with self._lock:
                self._spans.append((name, begin_us, end_us - begin_us, tid, args or None))

    @contextlib.contextmanager
    def span(self, name: str, tid: int = COMPUTE, **args: Any) -> Iterator[None]:
        """A span ``name`` on the timeline's row ``tid`` around the with-block (nothing while off)."""
        if not self.on:
            yield
            return
        begin = self.now()
        try:
            yield
        finally:
            self.add(name, begin, self.now(), tid, **args)

    def events(self) -> List[Dict[str, Any]]:
        """This rank's spans as Chrome-trace complete events ("ph": "X"), pid = rank."""
        out = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
               {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": COMPUTE, "args": {"name": "training"}},
               {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": COMM,
                "args": {"name": "gradient exchange"}}] if self.on else []
        with self._lock:
            spans = list(self._spans)
        for name, ts, dur, tid, args in spans:
            event = {"name": name, "ph": "X", "ts": round(ts, 1), "dur": round(dur, 1), "pid": self.rank,
                     "tid": tid, "cat": "comm" if tid == COMM else "train"}
            if args:
                event["args"] = args
            out.append(event)
        return out


recorder = Timeline()  # this process's rank


def process_started_us() -> float:
    """When this process began, in the timeline's clock. Not psutil's create_time: that adds
    the process's age in clock ticks to the boot time, which Linux gives in whole seconds (up to
    a second off); its age from /proc/uptime is good to a tick.

    >>> process_started_us() <= Timeline.now()
    True
    """
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks since boot
        return (time.time() - age) * 1e6
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process().create_time() * 1e6


def merge(per_rank: List[List[Dict[str, Any]]], path: str) -> str:
    """Write every rank's events as one Chrome-trace JSON at ``path``; the path."""
    import json

    events = [e for rank_events in per_rank for e in rank_events]
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path


def requested() -> Optional[str]:
    """The path run() users ask for: SPARKRING_TIMELINE, or Horovod's HOROVOD_TIMELINE."""
    return os.environ.get(environment.TIMELINE) or os.environ.get(environment.HOROVOD_TIMELINE) or None
