"""Horovod-style collective API used inside a rank: ``import sparkring.collective as sr``.

>>> import sparkring.collective as sr
>>> sr.init()
>>> sr.allreduce(torch.ones(2), op=sr.Sum)  # doctest: +SKIP
"""
from ..errors import HorovodInternalError, MismatchError, NotInitializedError
from . import (
    _replay,  # noqa: F401 - registers what a joined rank does (a new-ring hook)
    elastic,  # Horovod's hvd.elastic: TorchState, ElasticSampler, the run decorator
)
from .basics import (
    backend,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    nccl_enabled,
    rank,
    rocm_built,
    shutdown,
    size,
)
from .compression import Compression
from .environment import rank_device
from .functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    check_same_shapes,
)
from .mesh import device_mesh
from .mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "backend", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "sparse_allreduce_async", "poll",
    "synchronize", "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "allgather_object", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "join", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "barrier", "broadcast_parameters", "broadcast_optimizer_state",
    "DistributedOptimizer", "Compression", "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "NotInitializedError", "HorovodInternalError", "MismatchError", "SyncBatchNorm", "gloo_built", "nccl_built",
    "mpi_built", "ccl_built", "ddl_built", "cuda_built", "rocm_built", "gloo_enabled", "nccl_enabled", "mpi_enabled",
    "mpi_threads_supported", "check_same_shapes", "ProcessSet", "add_process_set", "remove_process_set",
    "global_process_set", "rank_device", "device_mesh", "elastic",
]
