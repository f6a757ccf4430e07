"""Horovod's launch vocabulary on the driver: ``horovodrun``'s host lists (``-H host:slots,...``,
``--hostfile``) read and checked against the Spark session, and ``horovod.run()``'s keyword names
(``np``, ``min_np``, ``max_np``, ``use_gloo``, ``use_mpi``, ``hosts``, ``verbose``) translated into
``sparkring.run()``'s, so the seeds' launch lines move over as written."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ...errors import ConfigurationError

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class HostSlots:
    """One entry of a Horovod host list: a host and how many ranks it runs.

    >>> parse_hosts("localhost:4")
    [HostSlots(host='localhost', slots=4)]
    """

    host: str
    slots: int


def parse_hosts(text: str) -> List[HostSlots]:
    """``host[:slots],host[:slots],...`` (Horovod's ``-H``; a host without slots runs one rank)."""
    found = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        host, _, slots = entry.rpartition(":") if ":" in entry else (entry, "", "1")
        if not slots.isdigit() or int(slots) < 1:
            raise ConfigurationError(f"-H {text!r}: {entry!r} is not host:slots (e.g. localhost:4)")
        found.append(HostSlots(host, int(slots)))
    if not found:
        raise ConfigurationError(f"-H {text!r} names no host; e.g. -H localhost:4")
    return found


def read_hostfile(path: str) -> List[HostSlots]:
    """Horovod's hostfile: one ``host slots=N`` (or ``host:N``) per line; # starts a comment."""
    if not os.path.exists(path):
        raise ConfigurationError(f"--hostfile {path!r} does not exist")
    found = []
    with open(path) as f:
        for line in (raw.split("#", 1)[0].strip() for raw in f):
            if not line:
                continue
            host, _, rest = line.partition(" ")
            slots = rest.strip().removeprefix("slots=") if rest else ""
            found += parse_hosts(f"{host}:{slots}" if slots else host)
    if not found:
        raise ConfigurationError(f"--hostfile {path!r} names no host")
    return found


def ranks_from_hosts(hosts: List[HostSlots], num_proc: Optional[int], local_session: bool,
                     slots: Optional[int] = None) -> int:
    """How many ranks a host list asks for, checked against -np and the session: one host runs
    that many local ranks; several need a cluster whose executors run on them (and, where the
    session can tell, as many task slots).

    >>> ranks_from_hosts([HostSlots("localhost", 4)], None, local_session=True)
    4
    """
    total = sum(h.slots for h in hosts)
    if num_proc is not None and num_proc > total:
        raise ConfigurationError(f"-np {num_proc} is more than the {total} slot(s) the host list gives "
                                 f"({', '.join(f'{h.host}:{h.slots}' for h in hosts)}); raise the slots or lower -np")
    names = {h.host for h in hosts}
    if local_session and len(names) > 1:
        raise ConfigurationError(f"the host list names {len(names)} hosts ({', '.join(sorted(names))}) but Spark runs "
                                 "in local mode, on this machine only: start Spark on those hosts (a standalone "
                                 "master, YARN or Kubernetes) and pass --master, or give one host")
    if local_session and not names <= LOCAL_NAMES | {os.uname().nodename}:
        raise ConfigurationError(f"the host list names {sorted(names)} but Spark runs in local mode on this machine: "
                                 "use -H localhost:N, or pass --master for a cluster on that host")
    wanted = num_proc if num_proc is not None else total
    if slots is not None and wanted > slots:
        raise ConfigurationError(f"the host list asks for {wanted} ranks but this Spark session has {slots} task "
                                 "slot(s): give the executors more cores (or GPUs), or lower the slots")
    return wanted


HOROVOD_RUN_NAMES = ("np", "min_np", "max_np", "use_gloo", "use_mpi", "hosts", "verbose")


def translate_run_keywords(given: Dict[str, Any], ours: Dict[str, Any]) -> Dict[str, Any]:
    """``horovod.run()``'s keywords as ``sparkring.run()``'s: ``ours`` updated, each conflict refused
    (``hosts`` is left to ranks_from_hosts, which needs the session).

    >>> translate_run_keywords({"np": 2, "use_gloo": True}, {"num_proc": None, "backend": "auto"})
    {'num_proc': 2, 'backend': 'gloo'}
    """
    unknown = sorted(set(given) - set(HOROVOD_RUN_NAMES))
    if unknown:
        raise TypeError(f"run() got unexpected keyword argument(s) {unknown}; Horovod's names it takes are "
                        f"{', '.join(HOROVOD_RUN_NAMES)}")
    out = dict(ours)

    def take(horovod_name: str, our_name: str, value: Any, unset: Any = None) -> None:
        if out.get(our_name, unset) not in (unset, value):
            raise ConfigurationError(f"run(): {horovod_name}= (Horovod's name) and {our_name}= disagree "
                                     f"({value!r} vs {out[our_name]!r}); pass one of them")
        out[our_name] = value

    if given.get("use_gloo") and given.get("use_mpi"):
        raise ConfigurationError("run(): use_gloo=True and use_mpi=True: pass one of them")
    if "max_np" in given and given["max_np"] is not None:
        if given.get("np") is not None and given["np"] > given["max_np"]:
            raise ConfigurationError(f"run(): np={given['np']} is more than max_np={given['max_np']}")
        take("max_np", "num_proc", given["max_np"])  # the elastic target: sparkring grows back to num_proc
        if given.get("np") is not None and given.get("min_np") is None:
            take("np", "min_proc", given["np"])
    elif given.get("np") is not None:
        take("np", "num_proc", given["np"])
    if given.get("min_np") is not None:
        take("min_np", "min_proc", given["min_np"])
    if given.get("use_gloo"):
        take("use_gloo", "backend", "gloo", unset="auto")
    if given.get("use_mpi"):
        take("use_mpi", "backend", "mpi", unset="auto")
    if given.get("verbose") is not None:
        verbose = given["verbose"]
        out["verbose"] = (2 if verbose else 1) if isinstance(verbose, bool) else int(verbose)
    return out  # hosts= is checked against the session: ranks_from_hosts
