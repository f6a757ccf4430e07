"""The packages whose versions must agree between the driver and the executors (what
unpickling the ranks' function and their results needs), read on each side and compared in
the barrier stage's first rendezvous, so a skew fails with one message instead of an
unpickling traceback deep inside a task."""
from __future__ import annotations

import re
from typing import Dict, List, Mapping

from ._probe import installed_version

# name -> how many leading release numbers must agree (torch's local build tag, +cpu or +cu128,
# may differ: a CPU driver and GPU executors are a normal setup)
COMPARED = {"python": 2, "sparkring": 3, "torch": 3, "cloudpickle": 2, "pyarrow": 1}


def package_versions() -> Dict[str, str]:
    """This process's versions of the compared packages ("missing" where one is not installed).

    >>> sorted(package_versions())
    ['cloudpickle', 'pyarrow', 'python', 'sparkring', 'torch']
    """
    return {name: installed_version(name) for name in COMPARED}


def pinned(name: str) -> str:
    """``name==X.Y.Z`` for the installed release (no local build tag), or the bare name.

    >>> pinned("torch").startswith("torch==")
    True
    """
    version = installed_version(name)
    return f"{name}=={version.split('+')[0]}" if version not in ("missing", "unknown") else name


def _release(version: str, parts: int) -> tuple:
    numbers = re.findall(r"\d+", version.split("+", 1)[0])
    return tuple(numbers[:parts]) if version != "missing" else ("missing",)


def skew(driver: Mapping[str, str], executors: Mapping[str, Mapping[str, str]]) -> List[str]:
    """One line per executor host whose versions differ from the driver's where it matters.

    >>> skew({"torch": "2.13.0+cpu"}, {"10.0.0.7": {"torch": "2.12.1"}})
    ['10.0.0.7: torch 2.12.1 (driver 2.13.0+cpu)']
    """
    lines = []
    for host, theirs in executors.items():
        diffs = [f"{name} {theirs.get(name, 'missing')} (driver {driver[name]})" for name in COMPARED
                 if name in driver and _release(theirs.get(name, "missing"), COMPARED[name])
                 != _release(driver[name], COMPARED[name])]
        if diffs:
            lines.append(f"{host}: {', '.join(diffs)}")
    return lines


def skew_message(lines: List[str]) -> str:
    """What to do when executors run other versions than the driver (``lines``: what differs)."""
    return ("the executors run other versions than the driver, which breaks pickling the ranks' function and "
            "results:\n  " + "\n  ".join(lines) + "\nShip the driver's environment to the executors (a packed "
            "virtualenv with spark.archives and PYSPARK_PYTHON=./environment/bin/python) or install the same "
            "versions there")
