"""The layout of a rank's work directory, which its launcher and its worker process share."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkDir:
    """Where one rank's worker finds its function and leaves its result, error and stacks.

    >>> w = WorkDir("/tmp/sparkring-rank0-x"); w.result
    '/tmp/sparkring-rank0-x/result.pkl'
    """

    path: str

    @classmethod
    def create(cls, rank: int) -> "WorkDir":
        return cls(tempfile.mkdtemp(prefix=f"sparkring-rank{rank}-"))

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def payload(self) -> str:  # the pickled (fn, args, kwargs)
        return self._file("payload.pkl")

    @property
    def result(self) -> str:  # the pickled return value, written last (renamed into place)
        return self._file("result.pkl")

    @property
    def error(self) -> str:  # the traceback of a failed rank
        return self._file("error.txt")

    @property
    def raised(self) -> str:  # what a failed rank's code raised, as JSON: its type_name() and message
        return self._file("raised.json")

    @property
    def events(self) -> str:  # reports of a rank that cannot reach the driver (protocol lines)
        return self._file("events.jsonl")

    @property
    def stacks(self) -> str:  # faulthandler's dump on SIGUSR1
        return self._file("stacks.txt")

    @property
    def pid(self) -> str:  # the worker's own pid (under mpiexec it is not the launched one's)
        return self._file("pid")
