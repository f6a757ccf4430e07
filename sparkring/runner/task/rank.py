"""One rank's worker process as both launchers run it (a barrier task, and TorchDistributor's
local mode on the driver's host): its work directory, its start, its output pumped line by line,
and how it ended, read back."""
from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .. import protocol
from .process import describe_exit, dump_stacks, kill_tree, start_worker
from .workdir import WorkDir

TAIL_LINES = 40  # the output shown when a rank dies without a traceback


class RankProcess:
    """A started rank: ``on_line(stream, line)`` gets each line it prints, as it prints it.

    >>> rank = RankProcess(0, WorkDir.create(0), payload, env, lambda stream, line: print(line))  # doctest: +SKIP
    >>> supervise([rank], timeout=60); rank.returncode  # doctest: +SKIP
    0
    """

    def __init__(self, rank: int, workdir: WorkDir, payload: bytes, env: Dict[str, str],
                 on_line: Callable[[str, str], None]):
        self.rank = rank
        self.workdir = workdir
        self.tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
        self.stacks = ""  # where its threads were when supervise() killed it
        with open(workdir.payload, "wb") as f:
            f.write(payload)
        self.proc = start_worker(workdir.path, env)
        self._pumps = [threading.Thread(target=self._pump, args=(stream, name, on_line), daemon=True)
                       for stream, name in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr"))]
        for pump in self._pumps:
            pump.start()

    def _pump(self, stream, name: str, on_line: Callable[[str, str], None]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            on_line(name, line)
        stream.close()

    @property
    def pid(self) -> int:
        """The rank process's pid."""
        return self.proc.pid

    @property
    def returncode(self) -> Optional[int]:
        """Its exit code; None while it runs."""
        return self.proc.poll()

    def running(self) -> bool:
        """Whether it still runs."""
        return self.proc.poll() is None

    def failed(self) -> bool:
        """Whether it exited with an error."""
        return self.proc.poll() not in (None, 0)

    def dump_stacks(self) -> str:
        """Its threads' stacks (faulthandler's dump)."""
        return dump_stacks(self.proc, self.workdir.path)

    def kill(self) -> None:
        """Kill it and its children."""
        kill_tree(self.proc)

    def output_done(self, timeout: float = 5.0) -> None:
        """Wait until its last lines were handed on (the process has ended)."""
        for pump in self._pumps:
            pump.join(timeout=timeout)

    def failure(self) -> str:
        """Its traceback, or how it exited and what it printed last."""
        try:
            with open(self.workdir.error) as f:
                return f.read()
        except OSError:
            return (f"rank {self.rank}'s worker process {describe_exit(self.proc.returncode)}; last output:\n"
                    + "\n".join(self.tail))

    def raised(self) -> Tuple[Optional[str], Optional[str]]:
        """What its code raised: (errors.type_name(), message), or (None, None) where it did not
        get to say (it died, or ended before raising)."""
        try:
            with open(self.workdir.raised) as f:
                found = json.load(f)
            return found.get("type"), found.get("message")
        except (OSError, ValueError):
            return None, None

    def failed_at(self) -> float:
        """When it wrote its traceback (inf: it did not)."""
        try:
            return os.stat(self.workdir.error).st_mtime_ns
        except OSError:
            return float("inf")

    def result(self) -> bytes:
        """Its pickled return value."""
        with open(self.workdir.result, "rb") as f:
            return f.read()

    def events(self) -> Iterator[protocol.Event]:
        """What it reported while the driver was out of its reach."""
        if not os.path.exists(self.workdir.events):
            return
        with open(self.workdir.events, "rb") as f:
            for line in f:
                frame = protocol.loads(line)
                if isinstance(frame, protocol.Event):
                    yield frame

    def close(self) -> None:
        """Kill what is left of it (its process group too) and remove its work directory."""
        if self.running():
            kill_tree(self.proc)
        else:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        shutil.rmtree(self.workdir.path, ignore_errors=True)


def supervise(ranks: Sequence[RankProcess], timeout: Optional[float], poll_s: float = 0.05) -> List[RankProcess]:
    """Wait until every rank has ended or one has failed. Past ``timeout`` seconds, the ranks
    still running are killed (their stacks kept in ``.stacks``) and returned.

    >>> late = supervise(ranks, timeout=600)  # doctest: +SKIP
    """
    started = time.monotonic()
    while any(r.running() for r in ranks) and not any(r.failed() for r in ranks):
        if timeout is not None and time.monotonic() - started > timeout:
            late = [r for r in ranks if r.running()]
            for r in late:
                r.stacks = r.dump_stacks()
                r.kill()
            return late
        time.sleep(poll_s)
    return []


def first_to_fail(ranks: Sequence[RankProcess]) -> RankProcess:
    """The failed rank that wrote its traceback first: the others usually fail because it went away."""
    return min((r for r in ranks if r.failed()), key=RankProcess.failed_at)
