"""MPI backend over mpi4py: ranks started one by one (each under its own ``mpiexec -n 1``)
join into one communicator through MPI's dynamic-process calls.

Spark starts the ranks, not mpiexec, so there is no MPI_COMM_WORLD spanning them. Rank 0
opens an MPI port and publishes its name in the same TCPStore rendezvous the torch
backends use; every other rank connects in rank order and the growing group merges each
newcomer (MPI_Comm_accept/connect + MPI_Intercomm_merge), then a split orders the ranks.
This is written by hand because neither mpi4py nor torch.distributed offers a way to form
a communicator from independently launched processes.
"""
from __future__ import annotations

import datetime
from typing import List, Optional, Tuple

import numpy as np
import torch

from ._backend import Backend, Handle
from ._buffers import ResultBuffers
from ._store import client_store, rendezvous_store

_STORE_PREFIX = "sparkring/mpi/"

# MPI has no 16-bit floats in the standard or a bool type its arithmetic reductions accept:
# those travel widened (and come back narrowed) so every op works on every dtype torch has.
_WIDEN = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.uint8}


def _mpi():
    from mpi4py import MPI

    return MPI


def _ops():
    MPI = _mpi()
    return {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}


def _as_buffer(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (shares memory, so MPI writes land in it)."""
    return tensor.detach().numpy()


def _staged(tensor: torch.Tensor, op: str = "sum") -> Tuple[torch.Tensor, torch.Tensor]:
    """(target, work): MPI operates on ``work``; where that is a widened or contiguous copy,
    it is written back into ``target`` (``tensor`` itself, or its real view if complex, which
    only a sum reduces correctly)."""
    if tensor.is_complex() and op != "sum":
        raise ValueError(f"allreduce op {op!r} is not defined for complex tensors; use Sum or Average")
    target = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    wide = _WIDEN.get(target.dtype)
    if wide is not None:
        return target, target.to(wide)
    return target, target if target.is_contiguous() else target.contiguous()


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """Raw bytes of a tensor (copied to the host when on a GPU): point-to-point moves any dtype unchanged."""
    host = tensor.detach().cpu().contiguous()
    return _as_buffer(host.view(-1).view(torch.uint8)) if host.numel() else np.empty(0, np.uint8)


class _MPIHandle(Handle):
    def __init__(self, request, result: torch.Tensor, target: Optional[torch.Tensor],
                 work: Optional[torch.Tensor]):
        self._request = request
        self._result = result
        self._target = target
        self._work = work

    def wait(self) -> torch.Tensor:
        if self._request is not None:
            self._request.Wait()
            self._request = None
            if self._target is not None and self._work is not None and self._work is not self._target:
                self._target.copy_(self._work)
            self._work = self._target = None
        return self._result

    def is_completed(self) -> bool:
        if self._request is not None and self._request.Test():
            self.wait()
        return self._request is None


class MPIBackend(Backend):
    """An MPI communicator of ``size`` ranks formed through a TCPStore rendezvous.

    >>> backend = MPIBackend(0, 1, None, None, 60.0)  # a ring of one, no rendezvous
    >>> backend.allreduce_async(torch.ones(2), "sum").wait()
    tensor([1., 1.])
    """

    name = "mpi"

    def __init__(self, rank: int, size: int, master_addr: Optional[str], master_port: Optional[str],
                 timeout_s: float):
        MPI = _mpi()
        self.rank = rank
        self.size = size
        self._master = (master_addr, int(master_port)) if master_addr and master_port and size > 1 else None
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._store = None
        self._results = ResultBuffers()
        self._global = list(range(size))  # this communicator's ranks -> global ranks
        if self._master is None:
            self._comm = MPI.COMM_SELF.Dup()
        else:
            self._store = rendezvous_store(self._master[0], self._master[1], size, rank, self._timeout)
            self._comm = self._connect(self._store)
        if self._comm.Get_size() != size or self._comm.Get_rank() != rank:
            raise RuntimeError(f"MPI ring came out as rank {self._comm.Get_rank()} of "
                               f"{self._comm.Get_size()}, expected rank {rank} of {size}")

    def _connect(self, store):
        MPI = _mpi()
        rank, size = self.rank, self.size
        if rank == 0:
            port = MPI.Open_port()
            store.set(_STORE_PREFIX + "port", port)
            group = MPI.COMM_SELF
        else:
            # one newcomer at a time: every member takes part in accepting each of them
            if rank > 1:
                store.wait([f"{_STORE_PREFIX}joined/{rank - 1}"])
            port = store.get(_STORE_PREFIX + "port").decode()
            inter = MPI.COMM_SELF.Connect(port, root=0)
            group = inter.Merge(high=True)
            inter.Free()
            store.set(f"{_STORE_PREFIX}joined/{rank}", "1")
        for _newcomer in range(rank + 1, size):  # those who come after this rank
            inter = group.Accept(port, root=0)
            merged = inter.Merge(high=False)
            inter.Free()
            if group is not MPI.COMM_SELF:
                group.Free()
            group = merged
        if rank == 0:
            MPI.Close_port(port)
        ordered = group.Split(0, rank)
        if group is not MPI.COMM_SELF:
            group.Free()
        return ordered

    @property
    def device(self) -> Optional[torch.device]:
        return torch.device("cpu")  # MPI reads host memory; GPU tensors are staged through it

    def allreduce(self, tensor, op):
        # blocking MPI_Allreduce: MPICH's non-blocking schedule costs ~25% at 1 MB
        target, work = _staged(tensor, op)
        self._comm.Allreduce(_mpi().IN_PLACE, _as_buffer(work), _ops()[op])
        if work is not target:
            target.copy_(work)
        return tensor

    def out_of_place_applies(self, tensor):
        return tensor.device.type == "cpu" and tensor.dtype not in _WIDEN and not tensor.is_complex()

    def allreduce_new(self, tensor, op):
        out = self._results.like(tensor)
        self._comm.Allreduce(_as_buffer(tensor), _as_buffer(out), _ops()[op])
        return out

    def result_like(self, tensor):
        return self._results.like(tensor)

    def allreduce_async(self, tensor, op):
        target, work = _staged(tensor, op)
        request = self._comm.Iallreduce(_mpi().IN_PLACE, _as_buffer(work), _ops()[op])
        return _MPIHandle(request, tensor, target, work)

    def allgather_same_shape(self, tensor):
        _, work = _staged(tensor)
        out = torch.empty((self.size,) + tuple(work.shape), dtype=work.dtype)
        self._comm.Allgather(_as_buffer(work), _as_buffer(out))
        if tensor.is_complex():
            out = torch.view_as_complex(out)
        return [o.to(tensor.dtype) for o in out.unbind(0)]

    def broadcast_async(self, tensor, root_rank):
        target, work = _staged(tensor)
        return _MPIHandle(self._comm.Ibcast(_as_buffer(work), root=root_rank), tensor, target, work)

    def alltoall(self, outputs, inputs):
        for shift in range(self.size):
            dst = (self.rank + shift) % self.size
            src = (self.rank - shift) % self.size
            if shift == 0:
                outputs[self.rank].copy_(inputs[self.rank])
                continue
            received = torch.empty(outputs[src].numel() * outputs[src].element_size(), dtype=torch.uint8)
            self._comm.Sendrecv(_bytes(inputs[dst]), dest=dst, recvbuf=_as_buffer(received), source=src)
            outputs[src].copy_(received.view(outputs[src].dtype).view(outputs[src].shape))

    def send(self, tensor, dst):
        self._comm.Send(_bytes(tensor), dest=dst)

    def recv(self, tensor, src):
        received = torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8)
        self._comm.Recv(_as_buffer(received), source=src)
        tensor.copy_(received.view(tensor.dtype).view(tensor.shape))

    def broadcast_object(self, obj, root_rank):
        return self._comm.bcast(obj, root=root_rank)

    def allgather_object(self, obj):
        return self._comm.allgather(obj)

    def barrier(self):
        self._comm.Barrier()

    def subgroup(self, ranks: List[int]) -> Optional["MPIBackend"]:
        """The communicator of ``ranks`` only (MPI_Comm_split; every rank calls it, ranks
        outside get MPI_COMM_NULL and None)."""
        MPI = _mpi()
        member = self.rank in ranks
        comm = self._comm.Split(0 if member else MPI.UNDEFINED, ranks.index(self.rank) if member else 0)
        if not member:
            return None
        sub = object.__new__(type(self))
        sub.__dict__.update(self.__dict__)
        sub._comm, sub._global = comm, list(ranks)
        sub.rank, sub.size = ranks.index(self.rank), len(ranks)
        sub._results = ResultBuffers()
        return sub

    def release(self) -> None:
        """Free this subgroup's communicator (a process set being removed)."""
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def group_rank(self, global_rank: int) -> int:
        if global_rank not in self._global:
            raise ValueError(f"rank {global_rank} is not in this process set (ranks {self._global})")
        return self._global.index(global_rank)

    def rendezvous(self):
        return self._store if self.size > 1 else None

    def join_stores(self):
        if self._master is None:
            return None
        return self._store, client_store(self._master[0], self._master[1], self._timeout)

    def shutdown(self):
        # MPI itself stays initialized (it cannot be initialized twice in one process);
        # a later init() forms a new communicator
        if self._comm is not None:
            self._comm.Free()
            self._comm = None
        self._store = None


def threads_supported() -> bool:
    """True when the MPI library runs calls from several threads at once."""
    MPI = _mpi()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE
