"""Shared-memory segments that the ranks of one host map together (a host's ranks hold a
split's decoded rows once): local rank 0 makes each one, every local rank maps it, and its name
is unlinked once all have, so nothing stays in /dev/shm after any exit, SIGKILL included.

Written by hand for the reason the shared-memory allreduce is (``_shm``): torch and the Python
standard library have no segment that a set of processes agree on through a collective;
``multiprocessing.shared_memory`` leaves names behind a killed process and tracks them in a
resource tracker that is the parent's, not the ranks'.
"""
from __future__ import annotations

import logging
import mmap
import os
import platform
import uuid
from dataclasses import dataclass
from typing import List, Optional, Sequence

from . import _runtime, basics
from ._shm import SHM_DIR, HostLayout, host_id, segment_fd

logger = logging.getLogger(__name__)

NAME_PREFIX = "sparkring-host-"


@dataclass
class HostSegment:
    """One mapped segment of ``nbytes`` shared by the ``local_size`` ranks of this host; ``fd``
    stays open for byte-range locks (``fcntl.lockf``) on it after its name is gone.

    >>> segments = host_segments([1 << 20])  # doctest: +SKIP
    >>> segments[0].mm[:4] if segments[0] else None  # doctest: +SKIP
    """

    mm: mmap.mmap
    fd: int
    nbytes: int
    local_rank: int
    local_size: int

    def close(self) -> None:
        """Unmap it and close the descriptor (numpy views of it must be gone first)."""
        self.mm.close()
        os.close(self.fd)


def unusable_reason(nbytes: int) -> Optional[str]:
    """Why this host cannot hold ``nbytes`` shared between its ranks, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        # readers look at a progress word, then at the data it covers: x86-64 keeps stores in order
        return f"{platform.machine()} orders stores weakly; shared segments are x86-64 only"
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as exc:
        return f"{SHM_DIR} is not available ({exc})"
    free = st.f_bavail * st.f_frsize
    if free < 2 * nbytes:
        return f"{SHM_DIR} has {free / 2**20:.0f} MiB free for {nbytes / 2**20:.0f} MiB (twice that, to be safe)"
    return None


def host_segments(sizes: Sequence[int]) -> List[Optional[HostSegment]]:
    """One segment of each size in ``sizes`` (0: none wanted), shared by this host's ranks: None
    where the host has one rank or cannot hold it (logged). Collective: every rank calls it with
    the same sizes.

    >>> [s.nbytes if s else None for s in host_segments([4096, 0])]  # doctest: +SKIP
    [4096, None]
    """
    rank = basics.rank()
    layouts = HostLayout.of([str(h) for h in _runtime.gather_objects(host_id())])
    local_ranks = layouts[rank].local_ranks
    local_rank = local_ranks.index(rank)
    names: List[Optional[str]] = [None] * len(sizes)
    made: List[Optional[HostSegment]] = [None] * len(sizes)
    if len(local_ranks) > 1 and local_rank == 0:
        token = uuid.uuid4().hex[:12]
        for i, nbytes in enumerate(sizes):
            reason = unusable_reason(nbytes) if nbytes else "none wanted"
            if reason is None:
                name = f"{NAME_PREFIX}{token}-{i}"
                try:
                    made[i] = _map(name, nbytes, create=True, local_rank=0, local_size=len(local_ranks))
                    names[i] = name
                except OSError as exc:
                    reason = f"cannot reserve {nbytes / 2**20:.0f} MiB in {SHM_DIR} ({exc})"
            if nbytes and reason is not None:
                logger.info("segment %d of %d bytes is not shared on this host: %s", i, nbytes, reason)
    try:
        mapped = _map_leaders(names, made, sizes, local_ranks, local_rank)
    finally:
        for made_name in names:
            if made_name is not None:  # every local rank has tried (or the ring broke): no longer needed
                os.unlink(os.path.join(SHM_DIR, made_name))
    for i in range(len(sizes)):
        if made[i] is not None and not all(mapped[r][i] for r in local_ranks):
            made[i].close()  # type: ignore[union-attr]
            made[i] = None
    return made


def _map_leaders(names: List[Optional[str]], made: List[Optional[HostSegment]], sizes: Sequence[int],
                 local_ranks: List[int], local_rank: int) -> List[List[bool]]:
    """Map the segments this host's local rank 0 made (``made`` filled in); which ones every rank mapped."""
    leaders_names = _runtime.gather_objects(names)[local_ranks[0]]
    if local_rank > 0:
        for i, name in enumerate(leaders_names):
            if name is not None:
                try:
                    made[i] = _map(name, sizes[i], create=False, local_rank=local_rank, local_size=len(local_ranks))
                except OSError as exc:
                    logger.info("cannot map shared segment %s: %s", name, exc)
    return _runtime.gather_objects([s is not None for s in made])


def _map(name: str, nbytes: int, create: bool, local_rank: int, local_size: int) -> HostSegment:
    """Map segment ``name``, keeping its descriptor for the claims' locks."""
    fd = segment_fd(name, nbytes, create)
    try:
        return HostSegment(mmap.mmap(fd, nbytes), fd, nbytes, local_rank, local_size)
    except BaseException:
        os.close(fd)
        raise
