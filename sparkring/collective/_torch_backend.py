"""Gloo and NCCL backends over torch.distributed, rendezvous through a TCPStore."""
from __future__ import annotations

import datetime
import os
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from ._backend import Backend, Handle

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}


class _TorchHandle(Handle):
    def __init__(self, work, tensor: torch.Tensor):
        self._work = work
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._tensor

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


class TorchBackend(Backend):
    """torch.distributed process group (gloo or nccl) of ``size`` ranks."""

    def __init__(self, name: str, rank: int, size: int, master_addr: Optional[str],
                 master_port: Optional[int], timeout_s: float):
        self.name = name
        self.rank = rank
        self.size = size
        timeout = datetime.timedelta(seconds=timeout_s)
        if name == "nccl":
            torch.cuda.set_device(0)  # the runner narrows CUDA_VISIBLE_DEVICES to this rank's GPU
        self._start_timeout = datetime.timedelta(
            seconds=float(os.environ.get("SPARKRING_START_TIMEOUT", timeout_s)))
        self._master = (master_addr, int(master_port)) if master_addr else None
        if size == 1 and not master_addr:
            store = dist.HashStore()
        else:
            store = dist.TCPStore(master_addr, int(master_port), size, is_master=(rank == 0),
                                  timeout=self._start_timeout, wait_for_workers=False)
        self._store = store
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(name, store=store, rank=rank, world_size=size, timeout=timeout)
        self._group = None
        # Object collectives on nccl would move pickles through GPU memory; a gloo side
        # group keeps them on CPU and lets barrier() work without a device.
        self._cpu_group = dist.new_group(backend="gloo") if name == "nccl" else None

    def join_stores(self):
        if self.size == 1 or self._master is None:
            return None
        watcher = dist.TCPStore(self._master[0], self._master[1], is_master=False,
                                timeout=self._start_timeout, wait_for_workers=False)
        return self._store, watcher

    @property
    def device(self) -> Optional[torch.device]:
        return torch.device("cuda", torch.cuda.current_device()) if self.name == "nccl" else None

    def allreduce_async(self, tensor, op):
        work = dist.all_reduce(tensor, op=_OPS[op], async_op=True)
        return _TorchHandle(work, tensor)

    def allgather_same_shape(self, tensor):
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor.contiguous())
        return out

    def broadcast_async(self, tensor, root_rank):
        work = dist.broadcast(tensor, src=root_rank, async_op=True)
        return _TorchHandle(work, tensor)

    def alltoall(self, outputs, inputs):
        if self.name == "gloo":
            # gloo has no all_to_all in torch; pairwise exchange in a fixed schedule
            for shift in range(self.size):
                dst = (self.rank + shift) % self.size
                src = (self.rank - shift) % self.size
                if shift == 0:
                    outputs[self.rank].copy_(inputs[self.rank])
                    continue
                send = dist.isend(inputs[dst].contiguous(), dst)
                dist.recv(outputs[src], src)
                send.wait()
        else:
            dist.all_to_all(outputs, [t.contiguous() for t in inputs])

    def send(self, tensor, dst):
        dist.send(tensor.contiguous(), dst)

    def recv(self, tensor, src):
        dist.recv(tensor, src)

    def broadcast_object(self, obj, root_rank):
        box = [obj]
        dist.broadcast_object_list(box, src=root_rank, group=self._cpu_group)
        return box[0]

    def allgather_object(self, obj):
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._cpu_group)
        return out

    def barrier(self):
        if self._cpu_group is not None:
            dist.barrier(group=self._cpu_group)
        else:
            dist.barrier()

    def shutdown(self):
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

