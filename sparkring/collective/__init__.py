"""Horovod-style collective API used inside a rank: ``import sparkring.collective as sr``.

>>> import sparkring.collective as sr
>>> sr.init()
>>> sr.allreduce(torch.ones(2), op=sr.Sum)  # doctest: +SKIP
"""
from ._checks import check_same_shapes
from ._runtime import (NotInitializedError, backend, cross_rank, cross_size, gloo_built, init, is_initialized,
                       local_rank, local_size, mpi_built, mpi_threads_supported, nccl_built, rank, shutdown,
                       size)
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allreduce, allreduce_,
                  allreduce_async, allreduce_async_, alltoall, barrier, broadcast, broadcast_,
                  broadcast_async, broadcast_async_, grouped_allreduce, grouped_allreduce_, join, poll,
                  reducescatter, synchronize)
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
