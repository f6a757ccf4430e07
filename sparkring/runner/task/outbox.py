"""Where a barrier task's messages go: the live channel to the driver, the output records for
what must survive without it, and task 0's relay that stops the other ranks of a detached run."""
from __future__ import annotations

import collections
import threading
from typing import List, Optional

from .. import channel, protocol
from ..protocol import Abort, Cause, Error, Event, Frame, Hello, Log, Stacks, Started

MAX_LOG_LINES = 5000


class Outbox:
    """Where a task's messages go: the live channel, and the output records for what must
    survive without it (errors and stack dumps always; logs and events when detached)."""

    def __init__(self, live: Optional[channel.Connection], control: Optional[channel.Connection]):
        self.live = live
        self.control = control  # the relay of a detached run: errors stop the other ranks
        self.records: List[Frame] = []
        self.logs: collections.deque = collections.deque(maxlen=MAX_LOG_LINES)
        self.lock = threading.Lock()

    def send(self, frame: Frame) -> None:
        """Send ``frame`` live where connected, else keep it for the task's result; errors also stop the others."""
        if self.live is not None:
            self.live.send(frame)
        if isinstance(frame, Error) and self.control is not None:
            self.control.send(frame)
        if isinstance(frame, Log):
            if self.live is None:
                self.logs.append(frame)
        elif isinstance(frame, (Error, Stacks)) or (self.live is None and isinstance(frame, (Event, Started))):
            with self.lock:
                self.records.append(frame)

    def drain(self) -> List[Frame]:
        """What was kept: the last log lines, then the records."""
        with self.lock:
            return list(self.logs) + self.records


class Relay:
    """Task 0's hub for a detached run: the first error of the stage stops every other rank
    (asking them for their stacks when it was a timeout)."""

    def __init__(self, host: str, secret: bytes):
        self.failed = False
        self.caused = False
        self.lock = threading.Lock()
        self.server = channel.DriverChannel(host, secret, self.handle)

    def handle(self, frame: Frame, conn: channel.Connection) -> None:
        """Pass a rank's frame on (its Hello names the connection's rank)."""
        if isinstance(frame, Hello):
            conn.info["rank"] = frame.rank
        elif isinstance(frame, Error):
            with self.lock:
                first, self.failed = not self.failed, True
                cause = not frame.secondary and not self.caused
                self.caused = self.caused or cause
            if cause:  # every task reports this one: the others only lost their peer
                self.server.broadcast(Cause(error=frame))
            if first:
                rank = frame.rank
                timed_out = frame.kind == protocol.TIMEOUT
                reason = f"rank {rank} exceeded its timeout" if timed_out else f"rank {rank} failed"
                self.server.broadcast(Abort(reason=reason, dump=timed_out),
                                      where=lambda c: c.info.get("rank") != rank)
