"""What an MPI rank needs of its task beyond the others': MPI's listeners kept on the task's
interface, Open MPI's launcher allowed to start as root, and the shared-memory segments MPICH
leaves behind removed."""
from __future__ import annotations

import logging
import os
import time
from typing import Dict, Optional, Set

log = logging.getLogger(__name__)


def mpi_launch_env(iface: Optional[str], ip: str) -> Dict[str, str]:
    """Keep MPI's own listeners on the task's interface (loopback in local mode); where the
    executor runs as root (most containers), let Open MPI's mpiexec start the rank: it refuses
    root otherwise (seen on a GPU machine), as Horovod's launcher also allows. MPICH ignores both
    names."""
    env = {"MPIR_CVAR_CH3_INTERFACE_HOSTNAME": ip}
    if iface:
        env.update({"UCX_NET_DEVICES": iface, "FI_TCP_IFACE": iface, "FI_SOCKETS_IFACE": iface})
    if os.geteuid() == 0:
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    return env


SHM_DIR = "/dev/shm"
MPI_SHM_PREFIX = "mpich_shm_"


def mpi_shm_segments() -> Set[str]:
    """Names of MPICH's shared-memory segments in /dev/shm now."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(MPI_SHM_PREFIX)}
    except OSError:
        return set()


def remove_orphan_segments(before: Set[str], older_than_s: Optional[float] = None) -> int:
    """Unlink the MPICH segments made since ``before`` (or, with ``older_than_s``, any that
    old) that no process maps any more.

    Ranks end with os._exit (and killed ranks never finalize), so MPICH cannot unlink its
    segments; executors that live for weeks would fill /dev/shm. A segment still mapped by a
    live process (another run's rank on this host) is left alone; MPICH maps a segment as it
    creates it, so an unmapped one that is a minute old belongs to nobody.
    """
    new = mpi_shm_segments() - before
    if older_than_s is not None:
        now = time.time()
        new = {n for n in new if _age(n, now) >= older_than_s}
    if not new:
        return 0
    in_use: Set[str] = set()
    marker = f"{SHM_DIR}/{MPI_SHM_PREFIX}"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(marker)
                    if at >= 0:
                        in_use.add(line[at + len(SHM_DIR) + 1:].split()[0])
        except OSError:
            continue
    removed = 0
    for name in new - in_use:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
        except OSError:
            pass
    if removed:
        log.debug("removed %d MPI shared-memory segment(s) the ranks left in %s", removed, SHM_DIR)
    return removed


def _age(name: str, now: float) -> float:
    try:
        return now - os.stat(os.path.join(SHM_DIR, name)).st_mtime
    except OSError:
        return 0.0
