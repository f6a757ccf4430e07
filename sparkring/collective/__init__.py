"""Horovod-style collective API used inside a rank: ``import sparkring.collective as sr``.

>>> import sparkring.collective as sr
>>> sr.init()
>>> sr.allreduce(torch.ones(2), op=sr.Sum)  # doctest: +SKIP
"""
from ._api import (Adasum, Average, Max, Min, NotInitializedError, Product, Sum, allgather,
                   allgather_object, allreduce, allreduce_, allreduce_async, allreduce_async_,
                   alltoall, backend, barrier, broadcast, broadcast_, broadcast_async,
                   broadcast_async_, broadcast_object, broadcast_optimizer_state,
                   broadcast_parameters, check_same_shapes, cross_rank, cross_size, gloo_built,
                   grouped_allreduce, grouped_allreduce_, init, is_initialized, join, local_rank, local_size,
                   mpi_built, mpi_threads_supported, nccl_built, poll, rank, reducescatter, shutdown,
                   size, synchronize)
from ._optimizer import DistributedOptimizer
from .compression import Compression
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "backend", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "poll", "synchronize",
    "allgather", "allgather_object", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "join", "alltoall", "reducescatter", "barrier",
    "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
    "Compression", "Average", "Sum", "Min", "Max", "Product", "Adasum", "NotInitializedError",
    "SyncBatchNorm", "gloo_built", "nccl_built", "mpi_built", "mpi_threads_supported", "check_same_shapes",
]
