"""The run's ledger on the driver: what every rank said over the channel (or in the stage's
records) while the barrier stage ran, kept for the watch and the verdict."""
from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, TextIO, Tuple

from .. import protocol
from ..channel import DriverChannel
from ..protocol import (
    Abort,
    Arrived,
    ConnectionClosed,
    Detached,
    Done,
    Error,
    Event,
    Frame,
    Gathered,
    Hello,
    Join,
    Log,
    Probe,
    ProbeReceived,
    Stacks,
    Started,
)

log = logging.getLogger(__name__)
SAME_LOSS_S = 0.25  # tasks that go away this close together went with one loss (an executor, a host)


@dataclass(frozen=True)
class RankOutput:
    """Where the ranks' printed lines go on the driver (``None``: this process's own stream), and
    whether each line opens with the time it arrived (Horovod's ``stdout=``, ``stderr=``,
    ``prefix_output_with_timestamp=``).

    >>> RankOutput(out=io.StringIO(), timestamps=True)  # doctest: +SKIP
    """

    out: Optional[TextIO] = None
    err: Optional[TextIO] = None
    timestamps: bool = False


OWN_STREAMS = RankOutput()  # the ranks' lines on this process's stdout and stderr, as they come


class RunLedger:
    """What the driver learns over the channel while the barrier stage runs: one handler per
    frame type (``handle`` dispatches on the type alone)."""

    def __init__(self, num_proc: int, verbose: int, on_event, output: RankOutput = OWN_STREAMS):
        self.num_proc = num_proc
        self.verbose = verbose
        self.on_event = on_event
        self.out = output.out or sys.stdout
        self.err = output.err or sys.stderr
        self.timestamps = output.timestamps
        self.lock = threading.Lock()
        self.attempt = 0
        self.attempt_started = time.monotonic()
        self.hello: Dict[int, set] = {}
        self.executors: Dict[int, Dict[int, str]] = {}  # attempt -> rank -> its executor's host:port
        # attempt -> rank -> when its task's connection closed before it was done
        self.gone: Dict[int, Dict[int, float]] = {}
        self.arrived: set = set()
        self.timeouts: Dict[int, Dict[int, str]] = {}
        self.stacks: Dict[int, Dict[int, str]] = {}
        self.done: Dict[int, set] = {}
        self.errors: Dict[int, Error] = {}
        self.failed_at: Dict[int, float] = {}  # attempt -> when a rank of it failed or went away
        self.pids: List[int] = []
        self.channel: Optional[DriverChannel] = None
        self.detached = False
        self.joins: Dict[int, Dict[int, Tuple[Join, Any]]] = {}  # stage -> rank -> (join, its connection)
        self.join_started: Dict[int, float] = {}
        self.heard: Dict[int, Dict[int, float]] = {}  # attempt -> rank -> when its task's last frame came
        self.hosts: Dict[int, Dict[int, str]] = {}  # attempt -> rank -> the host its task said it is on

    def handle(self, msg: Frame, conn=None) -> None:
        """One frame from a rank: live from the channel (``conn``), or replayed from the
        stage's output records after it ended (``conn`` None)."""
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(self, msg, conn)
        if conn is not None and conn.info.get("task"):  # any frame says the task's host reaches us
            with self.lock:
                self.heard.setdefault(int(conn.info["attempt"]), {})[int(conn.info["rank"])] = time.monotonic()

    def silent_ranks(self, limit: float) -> Dict[int, str]:
        """The latest attempt's running ranks whose tasks sent nothing for ``limit`` seconds, with
        the hosts they are on: their hosts no longer reach the driver (or their executors froze).
        The ranks of such a host silent for half of ``limit`` count too (they beat a little later)."""
        now = time.monotonic()
        with self.lock:
            attempt = self.attempt
            finished = self.done.get(attempt, set()) | set(self.gone.get(attempt, {}))
            hosts = self.hosts.get(attempt, {})
            quiet = {rank: now - when for rank, when in self.heard.get(attempt, {}).items() if rank not in finished}
        lost_hosts = {hosts.get(rank, "") for rank, silence in quiet.items() if silence > limit}
        return {rank: hosts.get(rank, "") for rank, silence in sorted(quiet.items())
                if hosts.get(rank, "") in lost_hosts and silence > limit / 2}

    def _arrived(self, msg: Arrived, conn) -> None:
        with self.lock:
            self.arrived.add(msg.rank)

    def _detached(self, msg: Detached, conn) -> None:
        self.detached = True

    def _closed(self, msg: ConnectionClosed, conn) -> None:
        if conn is None:
            return
        self.forget_joins_of(conn)
        if conn.info.get("task"):
            rank, attempt = int(conn.info["rank"]), int(conn.info["attempt"])
            with self.lock:
                if rank not in self.done.get(attempt, set()):
                    self.failed_at.setdefault(attempt, time.monotonic())
                    self.gone.setdefault(attempt, {}).setdefault(rank, time.monotonic())

    def _started(self, msg: Started, conn) -> None:
        with self.lock:
            self.pids.append(msg.pid)

    def _log(self, msg: Log, conn) -> None:
        self._print(msg.rank, msg.stream, msg.line)

    def _event(self, msg: Event, conn) -> None:
        if self.on_event is not None:
            try:
                self.on_event(msg.rank, msg.payload)
            except Exception as exc:  # noqa: BLE001 - a progress bug must not kill training
                print(f"sparkring: on_event callback failed: {exc!r}", file=self.err)

    def _probe(self, msg: Probe, conn) -> None:
        if conn is not None:  # at once: the rank times its link until this arrives
            conn.send(ProbeReceived(size=len(msg.data)))

    def _stacks(self, msg: Stacks, conn) -> None:
        with self.lock:
            self.stacks.setdefault(msg.attempt, {})[msg.rank] = msg.stacks

    def _done(self, msg: Done, conn) -> None:
        with self.lock:
            self.done.setdefault(msg.attempt, set()).add(msg.rank)

    def _join(self, msg: Join, conn) -> None:
        """Gather the tasks' rendezvous records here; once every rank of the stage joined, each
        gets all of them. A newer join of a rank replaces an older one (a retried stage)."""
        if conn is None:
            return  # only a live task joins
        with self.lock:
            group = self.joins.setdefault(msg.stage, {})
            self.join_started.setdefault(msg.stage, time.monotonic())
            group[msg.rank] = (msg, conn)
            if len(group) < self.num_proc:
                return
            del self.joins[msg.stage]
            self.join_started.pop(msg.stage, None)
        records = [group[rank][0].record for rank in range(self.num_proc)]
        for _, member in group.values():
            member.send(Gathered(records=records))

    def forget_joins_of(self, conn) -> None:
        """A task's connection closed: its join is stale (its stage attempt failed)."""
        with self.lock:
            for group in self.joins.values():
                for rank in [r for r, (_, c) in group.items() if c is conn]:
                    del group[rank]

    def expire_joins(self, window: float) -> None:
        """Joins that waited ``window`` seconds without every rank: some task cannot reach the
        driver, so all of them gather through Spark's allGather (decided here once per stage)."""
        now = time.monotonic()
        with self.lock:
            late = [stage for stage, since in self.join_started.items() if now - since > window]
            groups = [self.joins.pop(stage) for stage in late]
            for stage in late:
                del self.join_started[stage]
        for group in groups:
            log.info("not every task reached the driver: the ranks meet through Spark's allGather")
            for _, member in group.values():
                member.send(Gathered(records=None))

    def _hello(self, msg: Hello, conn) -> None:
        if conn is not None:
            conn.info.update(rank=msg.rank, attempt=msg.attempt, task=True)
        with self.lock:
            if msg.attempt > self.attempt or not self.hello:
                if msg.attempt > self.attempt:
                    self.attempt_started = time.monotonic()
                self.attempt = max(self.attempt, msg.attempt)
            self.hello.setdefault(msg.attempt, set()).add(msg.rank)
            self.hosts.setdefault(msg.attempt, {})[msg.rank] = msg.host
            if msg.executor:
                self.executors.setdefault(msg.attempt, {})[msg.rank] = msg.executor

    def lost_ranks(self) -> Dict[int, str]:
        """The latest attempt's ranks whose tasks went away first, with their executors'
        addresses ("" unknown). Spark then kills the stage's other tasks, whose connections close
        later: only those gone within ``SAME_LOSS_S`` of the first count as lost."""
        with self.lock:
            if not self.gone:
                return {}
            attempt = max(self.gone)
            when = self.gone[attempt]
            first = min(when.values())
            where = self.executors.get(attempt, {})
            return {rank: where.get(rank, "") for rank in sorted(when) if when[rank] - first <= SAME_LOSS_S}

    def executor_of(self, rank: int, attempt: int) -> Optional[str]:
        """The executor rank ``rank`` ran on in attempt ``attempt`` (None where unknown)."""
        with self.lock:
            return self.executors.get(attempt, {}).get(rank) or None

    def _error(self, msg: Error, conn) -> None:
        rank, attempt = msg.rank, msg.attempt
        with self.lock:
            if msg.kind == protocol.TIMEOUT:
                self.timeouts.setdefault(attempt, {})[rank] = msg.traceback
            first = attempt not in self.errors
            self.failed_at.setdefault(attempt, time.monotonic())
            if first or (self.errors[attempt].secondary and not msg.secondary):
                self.errors[attempt] = msg  # a rank that only lost its peer yields to the cause
        if first and self.channel is not None and conn is not None:
            timed_out = msg.kind == protocol.TIMEOUT
            reason = f"rank {rank} exceeded its timeout" if timed_out else f"rank {rank} failed"
            self.channel.broadcast(Abort(reason=reason, dump=timed_out),
                                   where=lambda c: bool(c.info.get("task")) and c.info.get("attempt") == attempt
                                   and c.info.get("rank") != rank)

    def _print(self, rank: int, stream: Optional[str], line: str) -> None:
        if self.verbose <= 0 or (self.verbose == 1 and rank != 0):
            return
        target = self.err if stream == "stderr" else self.out
        text = f"[{rank}] {line}" if self.verbose >= 2 else line
        if self.timestamps:
            text = f"{time.strftime('%a %b %d %H:%M:%S %Y')} {text}"
        with self.lock:
            print(text, file=target, flush=True)

    def first_error(self) -> Optional[Error]:
        """The latest attempt's error: a timeout where a rank ran out of time (the others'
        errors then only say that it was killed), else the first error."""
        with self.lock:
            if not self.errors:
                return None
            attempt = max(self.errors)
            timed_out = self.timeouts.get(attempt)
            if timed_out:
                rank = min(timed_out)
                return Error(rank=rank, attempt=attempt, kind=protocol.TIMEOUT, traceback=timed_out[rank])
            return self.errors[attempt]

    _handlers: Dict[type, Callable[["RunLedger", Any, Any], None]] = {
        Arrived: _arrived, Detached: _detached, Hello: _hello, ConnectionClosed: _closed, Started: _started,
        Log: _log, Event: _event, Stacks: _stacks, Done: _done, Error: _error, Join: _join, Probe: _probe,
    }
