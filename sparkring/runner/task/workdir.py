"""The layout of a rank's work directory, which its launcher and its worker process share, and
the removal of those that dead launchers left behind (a task killed with its executor cannot
clean up after itself)."""
from __future__ import annotations

import glob
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import List, Optional

log = logging.getLogger(__name__)

PREFIX = "sparkring-rank"
UNCLAIMED_AFTER_S = 3600.0  # a directory without its owner file is a launcher's that died creating it


@dataclass(frozen=True)
class WorkDir:
    """Where one rank's worker finds its function and leaves its result, error and stacks.

    >>> w = WorkDir("/tmp/sparkring-rank0-x"); w.result
    '/tmp/sparkring-rank0-x/result.pkl'
    """

    path: str

    @classmethod
    def create(cls, rank: int) -> "WorkDir":
        """A new work directory, owned by this process (the task that launches the rank); what
        dead owners left in the same temporary directory is removed first."""
        remove_abandoned()
        workdir = cls(tempfile.mkdtemp(prefix=f"{PREFIX}{rank}-"))
        # renamed into place: a launcher cleaning up at the same moment never reads half of it
        with open(workdir.owner + ".new", "w") as f:
            f.write(_identity(os.getpid()) or "")
        os.replace(workdir.owner + ".new", workdir.owner)
        return workdir

    @property
    def owner(self) -> str:
        """'<pid> <start time>' of the process that made the directory (and removes it)."""
        return self._file("owner")

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def payload(self) -> str:
        """The pickled (fn, args, kwargs)."""
        return self._file("payload.pkl")

    @property
    def result(self) -> str:
        """The pickled return value, written last (renamed into place)."""
        return self._file("result.pkl")

    @property
    def error(self) -> str:
        """The traceback of a failed rank."""
        return self._file("error.txt")

    @property
    def raised(self) -> str:
        """What a failed rank's code raised, as JSON: its type_name() and message."""
        return self._file("raised.json")

    @property
    def events(self) -> str:
        """The reports of a rank that cannot reach the driver (protocol lines)."""
        return self._file("events.jsonl")

    @property
    def stacks(self) -> str:
        """faulthandler's dump on SIGUSR1."""
        return self._file("stacks.txt")

    @property
    def pid(self) -> str:
        """The worker's own pid (under mpiexec, not the launched process's)."""
        return self._file("pid")


def _identity(pid: int) -> Optional[str]:
    """A process as "<pid> <start time>" (a pid alone may be reused), or None where none runs: the
    start in clock ticks since boot from /proc (exact; psutil's create_time adds a boot time that
    Linux gives in whole seconds), else psutil's."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f"{pid} {f.read().rsplit(')', 1)[1].split()[19]}"
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None  # Linux, and no such process
    except (OSError, IndexError):
        return None
    import psutil

    try:
        return f"{pid} {psutil.Process(pid).create_time():.0f}"
    except psutil.Error:
        return None


def remove_abandoned(folder: Optional[str] = None) -> List[str]:
    """Remove the rank work directories under ``folder`` (the temporary directory) whose owner
    process is gone; a live owner's are never touched. The paths removed.

    >>> remove_abandoned(tempfile.mkdtemp())
    []
    """
    removed = []
    for path in glob.glob(os.path.join(folder or tempfile.gettempdir(), f"{PREFIX}*-*")):
        try:
            with open(os.path.join(path, "owner")) as f:
                owner = f.read().split()
        except FileNotFoundError:
            owner = []
        except OSError:
            continue
        if len(owner) != 2 or not owner[0].isdigit():  # not claimed yet, or by a launcher that died claiming it
            try:
                abandoned = time.time() - os.path.getmtime(path) > UNCLAIMED_AFTER_S
            except OSError:
                continue
        else:
            abandoned = _identity(int(owner[0])) != " ".join(owner)
        if abandoned:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d work director(ies) of rank launchers that died: %s", len(removed), removed)
    return removed
