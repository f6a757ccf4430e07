"""Gloo and NCCL backends over torch.distributed, rendezvous through a TCPStore."""
from __future__ import annotations

import datetime
import functools
import pickle
from concurrent.futures import Future
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from ..errors import HorovodInternalError, SparkRingError, is_peer_loss
from ._backend import Backend, Handle, RingHealth
from ._buffers import ResultBuffers
from ._shm import HostRing
from ._store import client_store, rendezvous_store
from .environment import rank_device

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}


# Out-of-place allreduce on gloo moves the data itself with point-to-point messages: gloo's
# allreduce works in place only, so a new result would cost a full copy of the input on top
# of the reduction. Each gloo message costs ~50 us of CPU plus a thread wake-up, which on
# small hosts is what separates a Python-driven exchange from gloo's C++ ring, so both
# algorithms below use few, large messages.
SWAP_MIN_BYTES = 1024 * 1024  # two ranks: below this, gloo plus a copy is as fast
SWAP_MAX_BYTES = 8 * 1024 * 1024  # two ranks: above this, the ring's half-size adds win
RING_MIN_BYTES = 2 * 1024 * 1024  # three or more ranks
_SEGMENT_BYTES = 4 * 1024 * 1024
_REDUCE_TAG, _GATHER_TAG, _SWAP_TAG = 0, 1, 2
_COMBINE = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum, "product": torch.mul}


def _isend(tensor: torch.Tensor, dst: int, group, tag: int = 0) -> dist.Work:
    work = dist.isend(tensor, dst, group=group, tag=tag)
    if work is None:  # torch returns None to ranks outside the group; ours are always inside
        raise RuntimeError(f"isend to {dst}: this rank is not in the group")
    return work


def _irecv(tensor: torch.Tensor, src: int, group, tag: int = 0) -> dist.Work:
    work = dist.irecv(tensor, src, group=group, tag=tag)
    if work is None:
        raise RuntimeError(f"irecv from {src}: this rank is not in the group")
    return work


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor of the same values: gloo's point-to-point path would hand a
    CUDA tensor's device pointer to its TCP transport."""
    return tensor.detach().to("cpu").contiguous() if tensor.device.type != "cpu" else tensor.contiguous()


def _peer_loss_raises_horovod_internal_error(cls):
    """Every public method of ``cls`` turns a transport error that says a peer went away into
    HorovodInternalError (chained to the original), as Horovod's collectives do."""
    for name, method in list(vars(cls).items()):
        if callable(method) and not name.startswith("_"):
            setattr(cls, name, _translated(method))
    return cls


def _translated(method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as exc:
            if isinstance(exc, SparkRingError) or not is_peer_loss(str(exc)):
                raise
            self._health.peer_lost = True
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise HorovodInternalError(f"the collective ring broke: a peer rank went away ({first_line})") from exc
    return call


class _Started:
    """A host ring's allreduce running on the ring's thread, as torch's Work: wait() raises what it raised."""

    def __init__(self, future: Future):
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()


@_peer_loss_raises_horovod_internal_error
class _TorchHandle(Handle):
    def __init__(self, work, tensor: torch.Tensor, health: RingHealth):
        self._work = work
        self._tensor = tensor
        self._health = health

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._tensor

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


@_peer_loss_raises_horovod_internal_error
class TorchBackend(Backend):
    """torch.distributed process group (gloo or nccl) of ``size`` ranks."""

    def __init__(self, name: str, rank: int, size: int, master_addr: Optional[str],
                 master_port: Optional[str], timeout_s: float, start_timeout_s: float):
        self._owns_group = not dist.is_initialized()
        if not self._owns_group:  # the user's own init_process_group came first: use its group
            name = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
            rank, size = dist.get_rank(), dist.get_world_size()
        self.name = name
        self.rank = rank
        self.size = size
        timeout = datetime.timedelta(seconds=timeout_s)
        self._start_timeout = datetime.timedelta(seconds=start_timeout_s)
        self._master = (master_addr, int(master_port)) if master_addr and master_port else None
        store: dist.Store
        if self._master is None:
            if size > 1:
                raise ValueError(f"a ring of {size} ranks needs a master address and port")
            store = dist.HashStore()
        else:
            store = rendezvous_store(self._master[0], self._master[1], size, rank, self._start_timeout)
        self._store = store
        self._health = RingHealth()  # process sets share it (their __dict__ is a copy of this one's)
        self._results = ResultBuffers()
        self._scratch_bytes: Optional[torch.Tensor] = None
        if self._owns_group:
            dist.init_process_group(name, store=store, rank=rank, world_size=size, timeout=timeout)
        self._group = None                      # None: the default group (every rank)
        self._global = list(range(size))        # this group's ranks -> global ranks
        # Object collectives on nccl would move pickles through GPU memory; a gloo side
        # group keeps them on CPU and lets barrier() work without a device.
        self._cpu_group = dist.new_group(backend="gloo") if name == "nccl" else None
        # CPU allreduce between ranks of one host through shared memory (gloo goes through TCP)
        self._host_ring = HostRing.build(rank, size, timeout_s) if name == "gloo" and size > 1 else None
        if self._host_ring is not None:  # its peer checks report to the ring's health too
            self._host_ring.health = self._health

    def rendezvous(self):
        return self._store if self.size > 1 else None

    def peer_lost(self) -> bool:
        return self._health.peer_lost

    def join_stores(self):
        if self.size == 1 or self._master is None:
            return None
        return self._store, client_store(self._master[0], self._master[1], self._start_timeout)

    def group_rank(self, global_rank: int) -> int:
        if global_rank not in self._global:
            raise ValueError(f"rank {global_rank} is not in this process set (ranks {self._global})")
        return self._global.index(global_rank)

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.int32 if dtype == torch.int16 and self.name == "gloo" else dtype

    @property
    def device(self) -> Optional[torch.device]:
        return rank_device() if self.name == "nccl" else None

    def single_host_ring(self) -> Optional[HostRing]:
        """The shared-memory ring where it joins every rank of the ring on this one host."""
        ring = self._host_ring
        return ring if ring is not None and self._group is None and ring.hosts == 1 else None

    def _host_ring_for(self, tensor: torch.Tensor) -> Optional[HostRing]:
        """The shared-memory ring where it takes ``tensor`` (the whole ring's CPU tensors)."""
        if self._host_ring is not None and self._group is None and HostRing.supports(tensor):
            return self._host_ring
        return None

    def allreduce_async(self, tensor, op):
        ring = self._host_ring_for(tensor)
        if ring is not None:
            if tensor.is_contiguous():
                flat = tensor.view(-1)
                started = ring.allreduce_started(flat, flat, op)
                if started is not None:
                    return _TorchHandle(_Started(started), tensor, self._health)
                ring.allreduce(flat, flat, op)
            else:
                flat = tensor.reshape(-1)
                tensor.copy_(ring.allreduce(flat, flat, op).view(tensor.shape))
            return _TorchHandle(None, tensor, self._health)
        work = dist.all_reduce(tensor, op=_OPS[op], group=self._group, async_op=True)
        return _TorchHandle(work, tensor, self._health)

    def result_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._results.like(tensor)

    def out_of_place_applies(self, tensor: torch.Tensor) -> bool:
        if self._host_ring_for(tensor) is not None and tensor.is_contiguous():
            return True
        if not (self.name == "gloo" and self.size > 1 and tensor.device.type == "cpu"
                and tensor.is_contiguous() and tensor.dtype != torch.bool and not tensor.is_complex()):
            return False
        return tensor.numel() * tensor.element_size() >= (SWAP_MIN_BYTES if self.size == 2 else RING_MIN_BYTES)

    def out_of_place_algorithm(self, tensor: torch.Tensor) -> str:
        """"swap" (two ranks exchange whole tensors) or "ring" (reduce-scatter + allgather)."""
        swap = self.size == 2 and tensor.numel() * tensor.element_size() <= SWAP_MAX_BYTES
        return "swap" if swap else "ring"

    def allreduce_new(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        flat = tensor.reshape(-1)
        out = self._results.get(flat.numel(), flat.dtype)
        ring = self._host_ring_for(tensor)
        if ring is not None:
            return ring.allreduce(flat, out, op).view(tensor.shape)
        if self.out_of_place_algorithm(tensor) == "swap":
            self._swap_reduce(flat, out, _COMBINE[op])
        else:
            self._ring_reduce(flat, out, _COMBINE[op])
        return out.view(tensor.shape)

    def _swap_reduce(self, flat: torch.Tensor, out: torch.Tensor, combine) -> None:
        """Two ranks send each other their whole tensor and both combine: one message each
        way instead of the ring's four, for twice the (cheap) elementwise work."""
        peer = 1 - self.rank
        theirs = self._scratch(flat.numel(), flat.dtype)
        # send before receiving: measured 1.07-1.22x gloo's allreduce at 1-4 MB this way,
        # 0.8-0.9x with the receive posted first (the ring is the other way round)
        sent = _isend(flat, self._global[peer], group=self._group, tag=_SWAP_TAG)
        received = _irecv(theirs, self._global[peer], group=self._group, tag=_SWAP_TAG)
        received.wait()
        # rank 0's operand first on both ranks: min/max of signed zeros or NaNs depend on order
        first, second = (flat, theirs) if self.rank == 0 else (theirs, flat)
        combine(first, second, out=out)
        sent.wait()

    def _scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._scratch_bytes is None or self._scratch_bytes.numel() < nbytes:
            self._scratch_bytes = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch_bytes[:nbytes].view(dtype)

    def _ring_reduce(self, flat: torch.Tensor, out: torch.Tensor, combine) -> None:
        """Reduce-scatter then allgather around the ring, cut in segments that move on as
        soon as they are reduced, so receiving, reducing and sending overlap and the
        allgather starts while the reduction still runs."""
        n, rank = self.size, self.rank
        right, left = self._global[(rank + 1) % n], self._global[(rank - 1) % n]
        group = self._group
        bounds = [flat.numel() * i // n for i in range(n + 1)]
        seg = max(1, _SEGMENT_BYTES // flat.element_size())

        def segments(c: int):
            length = bounds[c + 1] - bounds[c]
            return [(bounds[c] + o, min(seg, length - o)) for o in range(0, length, seg)]

        reduce_tag, gather_tag = _REDUCE_TAG, _GATHER_TAG  # one FIFO per phase between neighbours
        # Every receive is posted before the first send: gloo then writes a message straight
        # into its destination as it arrives instead of holding the sender until the
        # receiver asks for it (measured 5-10% at 16 MB).
        # reduce-scatter: partials from the left land in the result itself and are combined
        # there in place (no staging buffers: 5-10% less memory traffic at 16 MB)
        jobs = [(step, a, m, _irecv(out[a:a + m], left, group=group, tag=reduce_tag))
                for step in range(n - 1) for a, m in segments((rank - step - 1) % n)]
        # allgather: final chunks arrive in the result too. With three or more ranks such a
        # region also held a partial sent on to the right; the final value only exists once
        # that partial went all the way round, so the send has read it long before.
        gathers = [(step, a, m, _irecv(out[a:a + m], left, group=group, tag=gather_tag))
                   for step in range(n - 1) for a, m in segments((rank - step) % n)]
        sends = [_isend(flat[a:a + m], right, group=group, tag=reduce_tag) for a, m in segments(rank)]
        for step, a, m, work in jobs:
            work.wait()
            partial = out[a:a + m]
            combine(flat[a:a + m], partial, out=partial)
            # the last step's result is final: it starts the allgather at once
            sends.append(_isend(partial, right, group=group, tag=reduce_tag if step < n - 2 else gather_tag))
        for step, a, m, work in gathers:
            work.wait()
            if step < n - 2:
                sends.append(_isend(out[a:a + m], right, group=group, tag=gather_tag))
        for work in sends:
            work.wait()

    def allgather_same_shape(self, tensor):
        ring = self._host_ring_for(tensor)
        if ring is not None and ring.gathers(tensor):
            return ring.allgather(tensor)
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor.contiguous(), group=self._group)
        return out

    def broadcast_async(self, tensor, root_rank):
        ring = self._host_ring_for(tensor)
        if ring is not None and ring.broadcasts():
            ring.broadcast(tensor, root_rank)
            return _TorchHandle(None, tensor, self._health)
        work = dist.broadcast(tensor, src=self._global[root_rank], group=self._group, async_op=True)
        return _TorchHandle(work, tensor, self._health)

    def alltoall(self, outputs, inputs):
        if self.name == "gloo":
            # gloo has no all_to_all in torch; pairwise exchange in a fixed schedule
            for shift in range(self.size):
                dst = (self.rank + shift) % self.size
                src = (self.rank - shift) % self.size
                if shift == 0:
                    outputs[self.rank].copy_(inputs[self.rank])
                    continue
                send = _isend(_on_host(inputs[dst]), self._global[dst], group=self._group)
                self.recv(outputs[src], src)
                send.wait()
        else:
            dist.all_to_all(outputs, [t.contiguous() for t in inputs], group=self._group)

    def send(self, tensor, dst):
        dist.send(_on_host(tensor) if self.name == "gloo" else tensor.contiguous(), self._global[dst],
                  group=self._group)

    def recv(self, tensor, src):
        if self.name == "gloo" and (tensor.device.type != "cpu" or not tensor.is_contiguous()):
            staged = torch.empty(tensor.shape, dtype=tensor.dtype)
            dist.recv(staged, self._global[src], group=self._group)
            tensor.copy_(staged)
        else:
            dist.recv(tensor, self._global[src], group=self._group)

    def broadcast_object(self, obj, root_rank):
        box = [obj]
        dist.broadcast_object_list(box, src=self._global[root_rank], group=self._cpu_group or self._group)
        return box[0]

    def allgather_object(self, obj):
        ring = self.single_host_ring()
        if ring is not None:  # a few shared-memory copies, not a gloo round trip of milliseconds
            parts = ring.allgather_bytes(pickle.dumps(obj))
            if parts is not None:
                return [pickle.loads(part) for part in parts]
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._cpu_group or self._group)
        return out

    def barrier(self):
        dist.barrier(group=self._cpu_group or self._group)

    def subgroup(self, ranks: List[int]) -> Optional["TorchBackend"]:
        """The ring of ``ranks`` only (every rank calls this, as torch's new_group needs);
        None on ranks outside it."""
        group = dist.new_group(ranks)
        cpu_group = dist.new_group(ranks, backend="gloo") if self.name == "nccl" else None
        if self.rank not in ranks:
            return None
        sub = object.__new__(type(self))
        sub.__dict__.update(self.__dict__)
        sub._owns_group = False
        sub._group, sub._cpu_group, sub._global = group, cpu_group, list(ranks)
        sub.rank, sub.size = ranks.index(self.rank), len(ranks)
        sub._results = ResultBuffers()
        sub._scratch_bytes = None
        sub._host_ring = None  # the shared segment belongs to the whole ring
        return sub

    def release(self) -> None:
        """Destroy this subgroup (a process set being removed)."""
        for group in (self._group, self._cpu_group):
            if group is not None:
                dist.destroy_process_group(group)

    def shutdown(self):
        if self._host_ring is not None:
            self._host_ring.close()
            self._host_ring = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

