"""Allreduce between the ranks of one host through a shared-memory segment, hierarchical
across hosts (one leader per host allreduces over gloo).

Written by hand because torch.distributed's CPU transport (gloo) moves every byte between
two processes on one host through TCP loopback, about 1 GB/s here, while the ranks share RAM
that copies at ~6 GB/s; oneCCL and DeepSpeed's CPU allreduces do not ship with torch.

Per chunk of at most ``chunk_bytes``: every rank copies its part into its slot of the segment
and raises its arrival flag; each rank reduces its 1/local_size slice of the chunk across the
slots into the result area (numpy ufuncs on the calling thread, in rank order, so every rank
gets bitwise the same result) and raises its reduced flag; with several hosts the host's
leader allreduces the result with the other leaders; every rank copies the result out. The
flags are int64 words in the segment, never a message per chunk; a rank raising one also bumps
its own 32-bit bell word and wakes whoever sleeps on it, and a rank waiting for a flag spins a
little, then sleeps on the bell of the rank it waits for (a futex): with more busy threads than
cores (a data-decoding thread beside each rank) a waiting rank frees its core instead of
spinning on it. A rank that is done copying out starts the next chunk's copy-in at once (its slot
is free: every rank has reduced), overlapping the slower ranks' copy-out. Small same-shaped
allgathers (the cross-rank argument check before every public collective) use the slots too.
The segment's name is unlinked as soon as every local rank has mapped it: nothing is left in
/dev/shm after any exit, SIGKILL included.

x86-64 only: its stores become visible in program order (data before flag); elsewhere the
ring falls back to gloo.
"""
from __future__ import annotations

import logging
import mmap
import os
import platform
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..errors import HorovodInternalError
from . import _futex, environment
from ._backend import RingHealth
from ._ring_worker import RingWorker

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "sparkring-ring-"
CHUNK_BYTES = 2 * 1024 * 1024  # 1-2 MiB measured fastest at 4-64 MB (the working set stays in cache)
_HEADER = 4096
_ALIGN = 64
_COMBINE: Dict[str, Callable[..., torch.Tensor]] = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum,
                                                    "product": torch.mul}
# numpy's ufuncs run on the calling thread: torch's would wake its OpenMP pool, whose spinning
# threads then compete for the cores the other local ranks copy and reduce on
_NUMPY_COMBINE = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}
_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64}
_SPINS_BEFORE_SLEEP = 50  # ~50-100 us: a peer that is nearly there is not slept on
_SLEEP_S = 0.05  # the longest sleep on a bell between looks at the flags
_PEER_CHECK_S = 0.2
_BELLS = 2048  # byte offset of the int32 bell words in the header; the int64 flags come before
_MAX_LOCAL_RANKS = (_BELLS // 8 - 1) // 2


@dataclass(frozen=True)
class HostLayout:
    """Which ranks share this rank's host, and the leaders (first rank of each host)."""

    local_ranks: List[int]
    leaders: List[int]

    @classmethod
    def of(cls, hosts: List[str]) -> List["HostLayout"]:
        """Each rank's layout, from every rank's host id (in rank order)."""
        order = list(dict.fromkeys(hosts))
        members = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
        leaders = [members[h][0] for h in order]
        return [cls(local_ranks=members[h], leaders=leaders) for h in hosts]


def host_id() -> str:
    """What identifies this rank's host: its hostname (SPARKRING_HOST_ID overrides it, for
    tests that simulate several hosts on one machine)."""
    return os.environ.get(environment.HOST_ID) or platform.node()


def segment_bytes(local_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Bytes of the segment for ``local_size`` ranks: one slot per rank and one result area."""
    return _HEADER + (local_size + 1) * chunk_bytes


def unusable_reason(local_size: int, chunk_bytes: int = CHUNK_BYTES) -> Optional[str]:
    """Why this host cannot run the shared-memory allreduce, or None."""
    if os.environ.get(environment.SHM, "1").strip().lower() in ("0", "false", "off", "no"):
        return f"{environment.SHM}=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} orders stores weakly; the shared-memory path is x86-64 only"
    if not _futex.available():
        return f"{platform.system()} has no futex to sleep on; the shared-memory path is Linux only"
    if local_size > _MAX_LOCAL_RANKS:
        return f"{local_size} ranks on one host: the shared-memory ring takes at most {_MAX_LOCAL_RANKS}"
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as exc:
        return f"{SHM_DIR} is not available ({exc})"
    free = st.f_bavail * st.f_frsize
    need = segment_bytes(local_size, chunk_bytes)
    if free < 2 * need:
        return (f"{SHM_DIR} has {free / 2**20:.0f} MiB free and the ring needs {need / 2**20:.0f} MiB (twice that "
                "to be safe): raise it (docker run --shm-size=1g, or a bigger emptyDir medium: Memory in Kubernetes)")
    return None


class HostRing:
    """Allreduce among the ranks of this host through one shared segment (and, with several
    hosts, over a gloo group of one leader per host). Every rank of the ring builds it together.

    >>> ring = HostRing.build(rank, size, timeout_s=1800)  # doctest: +SKIP
    >>> ring.allreduce(flat, flat, "sum") if ring else None  # doctest: +SKIP
    """

    def __init__(self, mm: mmap.mmap, local_rank: int, local_size: int, leader_group, is_leader: bool,
                 peer_pids: List[int], timeout_s: float, chunk_bytes: int, hosts: int):
        self._mm = mm
        self._bytes = torch.frombuffer(mm, dtype=torch.uint8)
        self._flags = np.frombuffer(mm, dtype=np.int64, count=_BELLS // 8)
        self._bells = np.frombuffer(mm, dtype=np.int32, count=local_size, offset=_BELLS)
        self._bell_at = self._bells.ctypes.data
        # numpy views of the slots and result area per dtype, made once: building torch views
        # and their .numpy() per chunk cost more than copying a 1 MB chunk
        self._np_areas: Dict[np.dtype, List[np.ndarray]] = {}
        self.local_rank = local_rank
        self.local_size = local_size
        self._leader_group = leader_group
        self._is_leader = is_leader
        self._peer_pids = peer_pids
        self._peer_starts = [_process_start(pid) for pid in peer_pids]
        self._timeout_s = timeout_s
        self.health = RingHealth()  # the backend hands in its ring's own after build()
        self._chunk = chunk_bytes
        self._generation = 0
        self.hosts = hosts
        n = local_size
        # flag words: arrived[n], reduced[n], crossed[1]
        self._arrived = slice(0, n)
        self._reduced = slice(n, 2 * n)
        self._crossed = 2 * n
        # across hosts an allreduce waits on the network: started ones run on a thread of the ring's own
        self._worker = RingWorker("sparkring host ring", inline=hosts == 1)

    # -- building ----------------------------------------------------------------------
    @classmethod
    def build(cls, rank: int, size: int, timeout_s: float, chunk_bytes: int = CHUNK_BYTES) -> Optional["HostRing"]:
        """This rank's HostRing, or None where no host has two ranks or any rank cannot use
        shared memory (then one warning says why). Collective: every rank calls it."""
        # host ids, and rank 0's token naming this ring's keys in the store (a store may outlive a ring)
        seen: List[Optional[Tuple[str, str]]] = [None] * size
        dist.all_gather_object(seen, (host_id(), uuid.uuid4().hex[:12]))
        layouts = HostLayout.of([str(h[0]) for h in seen])  # type: ignore[index]
        me = layouts[rank]
        if max(len(layout.local_ranks) for layout in layouts) < 2:
            return None
        local_rank, local_size = me.local_ranks.index(rank), len(me.local_ranks)
        nbytes = segment_bytes(local_size, chunk_bytes)
        name = f"{NAME_PREFIX}{seen[0][1]}-{me.leaders.index(me.local_ranks[0])}"  # type: ignore[index]
        reason = unusable_reason(local_size, chunk_bytes)
        mm: Optional[mmap.mmap] = None
        if reason is None and local_rank == 0:
            try:
                mm = _segment(name, nbytes, create=True)
            except OSError as exc:
                reason = f"cannot reserve {nbytes / 2**20:.0f} MiB in {SHM_DIR} ({exc})"
        reasons: List[Optional[str]] = [None] * size
        dist.all_gather_object(reasons, reason)
        # every rank takes part in new_group, leader or not (torch's rule)
        leader_group = dist.new_group(me.leaders, backend="gloo") if len(me.leaders) > 1 else None
        bad = [(r, why) for r, why in enumerate(reasons) if why]
        if bad:
            if mm is not None:
                mm.close()
                os.unlink(os.path.join(SHM_DIR, name))
            if rank == 0:
                logger.warning("allreduce between ranks on one host goes through gloo, not shared memory: rank %d: %s",
                               bad[0][0], bad[0][1])
            return None
        if mm is None:
            mm = _segment(name, nbytes, create=False)
        pids: List[Optional[int]] = [None] * size
        dist.all_gather_object(pids, os.getpid())  # also: every rank has mapped its segment
        if local_rank == 0:
            os.unlink(os.path.join(SHM_DIR, name))
        peer_pids = [int(pids[r]) for r in me.local_ranks if r != rank]  # type: ignore[arg-type]
        logger.info("allreduce on this host through shared memory: %d local ranks, %d host(s)", local_size,
                    len(me.leaders))
        return cls(mm, local_rank, local_size, leader_group, rank in me.leaders, peer_pids, timeout_s, chunk_bytes,
                   hosts=len(me.leaders))

    @staticmethod
    def supports(tensor: torch.Tensor) -> bool:
        """CPU tensors of the dtypes numpy (or torch, for bfloat16) reduces; every op is."""
        return tensor.device.type == "cpu" and tensor.dtype in _DTYPES

    # -- the allreduce -----------------------------------------------------------------
    def _area(self, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Slot ``index`` (0..local_size-1) or the result area (local_size)."""
        start = _HEADER + index * self._chunk
        return self._bytes[start:start + numel * dtype.itemsize].view(dtype)

    def _np_views(self, dtype: np.dtype) -> List[np.ndarray]:
        """Every slot and the result area as whole-chunk numpy arrays of ``dtype``."""
        views = self._np_areas.get(dtype)
        if views is None:
            count = self._chunk // dtype.itemsize
            views = [np.frombuffer(self._mm, dtype=dtype, count=count, offset=_HEADER + k * self._chunk)
                     for k in range(self.local_size + 1)]
            self._np_areas[dtype] = views
        return views

    def allreduce(self, source: torch.Tensor, out: torch.Tensor, op: str) -> torch.Tensor:
        """Reduce the flat contiguous ``source`` across the ring into the flat ``out`` (may be
        ``source`` itself), after the allreduces started before it."""
        return self._worker.run(self._allreduce_here, source, out, op)

    def allreduce_started(self, source: torch.Tensor, out: torch.Tensor, op: str) -> Optional[Future]:
        """``allreduce`` started on the ring's own thread across hosts, its future; None on one
        host, where the caller runs it (memory copies gain nothing from another thread)."""
        return self._worker.submit(self._allreduce_here, source, out, op)

    def _allreduce_here(self, source: torch.Tensor, out: torch.Tensor, op: str) -> torch.Tensor:
        if source.dtype == torch.bfloat16:  # numpy has no bfloat16: torch reduces it
            return self._allreduce_torch(source, out, op)
        combine = _NUMPY_COMBINE[op]
        src, dst = source.detach().numpy(), out.detach().numpy()
        areas = self._np_views(src.dtype)
        per_chunk = max(1, (self._chunk // source.element_size()) // _ALIGN * _ALIGN)
        n, me = self.local_size, self.local_rank
        for start in range(0, src.size, per_chunk):
            m = min(per_chunk, src.size - start)
            self._generation += 1
            g = self._generation
            np.copyto(areas[me][:m], src[start:start + m])
            self._raise(self._arrived.start + me, g)
            self._wait(self._arrived, g, "arrive")
            lo, hi = m * me // n, m * (me + 1) // n
            if hi > lo:
                result = areas[n][lo:hi]
                with np.errstate(all="ignore"):  # overflow to inf, as torch and gloo do, silently
                    combine(areas[0][lo:hi], areas[1][lo:hi], out=result)
                    for k in range(2, n):
                        combine(result, areas[k][lo:hi], out=result)
            self._raise(self._reduced.start + me, g)
            self._wait(self._reduced, g, "reduce")
            if self._leader_group is not None:
                self._cross_hosts(g, op, torch.from_numpy(areas[n][:m]))
            np.copyto(dst[start:start + m], areas[n][:m])
        return out

    def _allreduce_torch(self, source: torch.Tensor, out: torch.Tensor, op: str) -> torch.Tensor:
        combine = _COMBINE[op]
        per_chunk = max(1, (self._chunk // source.element_size()) // _ALIGN * _ALIGN)
        n, me = self.local_size, self.local_rank
        for start in range(0, source.numel(), per_chunk):
            m = min(per_chunk, source.numel() - start)
            self._generation += 1
            g = self._generation
            self._area(me, m, source.dtype).copy_(source[start:start + m])
            self._raise(self._arrived.start + me, g)
            self._wait(self._arrived, g, "arrive")
            lo, hi = m * me // n, m * (me + 1) // n
            if hi > lo:
                parts = [self._area(k, m, source.dtype)[lo:hi] for k in range(n + 1)]
                result = parts[n]
                combine(parts[0], parts[1], out=result)
                for k in range(2, n):
                    combine(result, parts[k], out=result)
            self._raise(self._reduced.start + me, g)
            self._wait(self._reduced, g, "reduce")
            if self._leader_group is not None:
                self._cross_hosts(g, op, self._area(n, m, source.dtype))
            out[start:start + m].copy_(self._area(n, m, source.dtype))
        return out

    def _cross_hosts(self, generation: int, op: str, result: torch.Tensor) -> None:
        """With several hosts, the leader allreduces this host's reduced chunk with the other
        leaders; the other local ranks wait for it."""
        if self._is_leader:
            dist.all_reduce(result, op=_REDUCE_OPS[op], group=self._leader_group)
            self._raise(self._crossed, generation)
        else:
            self._wait(slice(self._crossed, self._crossed + 1), generation, "cross-host allreduce")

    def broadcasts(self) -> bool:
        """Whether ``broadcast`` runs here: every rank of the ring is on this host."""
        return self.hosts == 1

    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        """Local rank ``root``'s ``tensor`` into every rank's ``tensor``, in place: per chunk
        the root copies in and raises its flag, the others copy out and raise theirs."""
        work = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
        data = work.view(-1).view(torch.uint8).numpy()
        area = self._np_views(np.dtype(np.uint8))[self.local_size]
        me = self.local_rank
        for start in range(0, data.size, self._chunk):
            m = min(self._chunk, data.size - start)
            self._generation += 1
            g = self._generation
            if me == root:
                np.copyto(area[:m], data[start:start + m])
                self._raise(self._arrived.start + me, g)
            else:
                self._wait(slice(self._arrived.start + root, self._arrived.start + root + 1), g, "broadcast")
                np.copyto(data[start:start + m], area[:m])
            self._raise(self._reduced.start + me, g)  # read: the area may be written again
            self._wait(self._reduced, g, "broadcast")
        if work.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                tensor.copy_(work)
        return tensor

    def gathers(self, tensor: torch.Tensor) -> bool:
        """Whether ``allgather`` takes ``tensor`` (one it supports): one host, and it fits one slot."""
        return self.hosts == 1 and tensor.numel() * tensor.element_size() <= self._chunk

    def allgather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        """Every local rank's ``tensor`` (same shape on every rank), in rank order: one copy in,
        one flag, each rank reads the others' slots (the cross-rank agreement before every
        public collective costs this instead of a gloo round trip)."""
        flat = tensor.reshape(-1)
        k = flat.numel()
        self._generation += 1
        g = self._generation
        if flat.dtype == torch.bfloat16:
            self._area(self.local_rank, k, flat.dtype).copy_(flat)
        else:
            areas = self._np_views(flat.numpy().dtype)
            np.copyto(areas[self.local_rank][:k], flat.numpy())
        self._raise(self._arrived.start + self.local_rank, g)
        self._wait(self._arrived, g, "allgather")
        if flat.dtype == torch.bfloat16:
            out = [self._area(j, k, flat.dtype).clone().view(tensor.shape) for j in range(self.local_size)]
        else:
            out = [torch.from_numpy(areas[j][:k].copy()).view(tensor.shape) for j in range(self.local_size)]
        self._raise(self._reduced.start + self.local_rank, g)  # read: the slots may be written again
        self._wait(self._reduced, g, "allgather")
        return out

    def allgather_bytes(self, data: bytes) -> Optional[List[bytes]]:
        """Every local rank's ``data`` in rank order (one host only), or None on every rank
        when the longest does not fit one slot (then the caller takes another path): the
        negotiation of Horovod's async operations pickles what each rank has queued."""
        sizes = self.allgather(torch.tensor([len(data)], dtype=torch.int64))
        longest = max(int(n) for n in sizes)
        if longest > self._chunk:
            return None
        mine = torch.zeros(max(1, longest), dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return [part[:int(n)].numpy().tobytes() for part, n in zip(self.allgather(mine), sizes)]

    # -- FSDP2's exchanges (one host): each rank moves about its input's bytes, not an allreduce's
    def all_gather_into(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (local_size x the flat ``shard``) gets every local rank's shard in rank order."""
        k, n, me = shard.numel(), self.local_size, self.local_rank
        step = max(1, self._chunk // shard.element_size())
        for start in range(0, k, step):
            m = min(step, k - start)
            self._generation += 1
            g = self._generation
            self._area(me, m, shard.dtype).copy_(shard[start:start + m])
            self._raise(self._arrived.start + me, g)
            self._wait(self._arrived, g, "all-gather")
            for j in range(n):
                out[j * k + start:j * k + start + m].copy_(self._area(j, m, shard.dtype))
            self._raise(self._reduced.start + me, g)  # read: the slots may be written again
            self._wait(self._reduced, g, "all-gather")

    def reduce_scatter_sum(self, full: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (the flat ``full``'s length / local_size) gets this local rank's block of the
        sum of every local rank's ``full``: per window each rank offers that window of every
        block, and sums the others' offers of its own block."""
        n, me = self.local_size, self.local_rank
        k = out.numel()
        step = max(1, self._chunk // (n * full.element_size()))
        for start in range(0, k, step):
            m = min(step, k - start)
            self._generation += 1
            g = self._generation
            mine = self._area(me, n * m, full.dtype).view(n, m)
            mine.copy_(full.view(n, k)[:, start:start + m])
            self._raise(self._arrived.start + me, g)
            self._wait(self._arrived, g, "reduce-scatter")
            target = out[start:start + m]
            torch.add(self._area(0, n * m, full.dtype).view(n, m)[me], self._area(1, n * m, full.dtype).view(n, m)[me],
                      out=target)
            for j in range(2, n):
                target.add_(self._area(j, n * m, full.dtype).view(n, m)[me])
            self._raise(self._reduced.start + me, g)
            self._wait(self._reduced, g, "reduce-scatter")

    def _raise(self, word: int, generation: int) -> None:
        """Set this rank's flag ``word`` to ``generation``, then ring this rank's bell."""
        self._flags[word] = generation
        me = self.local_rank
        self._bells[me] = (int(self._bells[me]) + 1) & 0x7FFFFFFF  # only this rank writes its bell
        _futex.wake(self._bell_at + 4 * me)

    def _writer(self, word: int) -> int:
        """The local rank that raises flag ``word``: arrived[k] and reduced[k] are rank k's,
        crossed is the leader's (local rank 0)."""
        n = self.local_size
        return word if word < n else word - n if word < 2 * n else 0

    def _wait(self, words: slice, generation: int, phase: str) -> None:
        flags = self._flags[words]
        if (flags >= generation).all():
            return
        started = time.monotonic()
        checked = started
        while True:
            for _ in range(_SPINS_BEFORE_SLEEP):
                if (flags >= generation).all():
                    return
            behind = int(np.argmin(flags >= generation))
            writer = self._writer(words.start + behind)
            bell = int(self._bells[writer])
            if flags[behind] < generation:  # read after the bell: a raise since then changed it
                _futex.wait(self._bell_at + 4 * writer, bell, _SLEEP_S)
            now = time.monotonic()
            if now - checked > _PEER_CHECK_S:
                checked = now
                self._check_peers(phase)
                if now - started > self._timeout_s:
                    raise HorovodInternalError(
                        f"shared-memory allreduce: waited {self._timeout_s:.0f}s at '{phase}' for a local rank "
                        "(collective timeout)")

    def _check_peers(self, phase: str) -> None:
        for pid, started in zip(self._peer_pids, self._peer_starts):
            if _process_start(pid) != started:
                self.health.peer_lost = True
                raise HorovodInternalError(f"the collective ring broke: a peer rank went away (process {pid} on "
                                           f"this host ended while this rank waited at '{phase}' of a shared-memory "
                                           "collective)")

    def close(self) -> None:
        """Unmap the segment (left to the OS at exit where an allreduce still waits on a lost peer)."""
        if not self._worker.stop():
            return
        self._flags = None  # type: ignore[assignment]
        self._bells = None  # type: ignore[assignment]
        self._bytes = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view of the segment is still alive somewhere: the OS frees it at exit
            pass


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
               "product": dist.ReduceOp.PRODUCT}


def _process_start(pid: int) -> Optional[str]:
    """When process ``pid`` started (its /proc start time), or None once it has ended — a
    zombie (killed, not yet reaped by its parent) counts as ended, and a reused pid shows a
    different start."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    except OSError:  # no /proc to read: alive as far as we can tell
        return "unknown"
    return None if fields[0] in ("Z", "X", "x") else fields[19]


def segment_fd(name: str, nbytes: int, create: bool) -> int:
    """A descriptor of segment ``name`` in SHM_DIR, created with every page reserved (a full
    /dev/shm then fails here, not with SIGBUS at the first copy)."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    if create:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
    return fd


def _segment(name: str, nbytes: int, create: bool) -> mmap.mmap:
    """Map the segment ``name`` (see segment_fd)."""
    fd = segment_fd(name, nbytes, create)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
