"""The public calls about the ring itself (Horovod's horovod/common/basics.py): init and shutdown, this
rank's place (rank, size, local and cross ranks), the transport in use, and what this build offers."""
from __future__ import annotations

from typing import Optional

import torch

from . import _runtime


def init(backend: Optional[str] = None) -> None:
    """Join the ring described by the runner's environment; idempotent.

    Without a runner (plain ``python train.py``) this forms a ring of one rank, so
    the same script runs alone.

    Arguments:
        backend: "gloo", "nccl", "mpi" or None (the runner's choice; alone: nccl where a GPU is visible, else gloo).

    Returns:
        None; the ring is formed (or already was).

    >>> import sparkring.collective as sr
    >>> sr.init(); sr.rank(), sr.size()
    (0, 1)
    """
    _runtime.join_ring(backend)


def shutdown() -> None:
    """Leave the ring; a later ``init()`` (on every rank) forms a new one, even while the
    caller still holds tensors, handles or optimizers from this one.

    Returns:
        None; ``is_initialized()`` is False until the next ``init()``.

    >>> sr.shutdown(); sr.is_initialized()  # doctest: +SKIP
    False
    """
    _runtime.leave_ring()


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``.

    Returns:
        True between ``init()`` and ``shutdown()``.

    >>> sr.is_initialized()  # doctest: +SKIP
    True
    """
    return _runtime.initialized()


def rank() -> int:
    """This process's rank, 0..size()-1.

    Returns:
        This rank's index in the ring, an int in 0..size()-1.

    >>> sr.rank()  # doctest: +SKIP
    0
    """
    return _runtime.current().rank


def size() -> int:
    """Number of ranks in the ring.

    Returns:
        The number of ranks in the ring.

    >>> sr.size()  # doctest: +SKIP
    2
    """
    return _runtime.current().size


def local_rank() -> int:
    """Rank among the ranks on this host (use it to pick a GPU).

    Returns:
        This rank's index among the ranks of its host.

    >>> sr.local_rank()  # doctest: +SKIP
    0
    """
    _runtime.current()
    return _runtime.state.local_rank


def local_size() -> int:
    """Number of ranks on this host.

    Returns:
        The number of ranks on this host.

    >>> sr.local_size()  # doctest: +SKIP
    2
    """
    _runtime.current()
    return _runtime.state.local_size


def cross_rank() -> int:
    """Index of this host among the hosts of the ring.

    Returns:
        The index of this rank's host among the hosts.

    >>> sr.cross_rank()  # doctest: +SKIP
    0
    """
    _runtime.current()
    return _runtime.state.cross_rank


def cross_size() -> int:
    """Number of hosts in the ring.

    Returns:
        The number of hosts in the ring.

    >>> sr.cross_size()  # doctest: +SKIP
    1
    """
    _runtime.current()
    return _runtime.state.cross_size


def backend() -> str:
    """Name of the transport in use: "gloo", "nccl" or "mpi".

    Returns:
        "gloo", "nccl" or "mpi".

    >>> sr.backend()  # doctest: +SKIP
    'gloo'
    """
    return _runtime.current().name


# -- what is built (Horovod's introspection calls) ------------------------------------

def gloo_built() -> bool:
    """True: gloo (CPU) collectives are available.

    Returns:
        True when torch.distributed has gloo.

    >>> sr.gloo_built()
    True
    """
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def nccl_built() -> bool:
    """True when this torch build has NCCL (GPU) collectives.

    Returns:
        True when torch.distributed has NCCL.

    >>> sr.nccl_built()  # doctest: +SKIP
    False
    """
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def mpi_built() -> bool:
    """True when mpi4py (and so the ``backend="mpi"`` transport) is installed.

    Returns:
        True when mpi4py can be imported.

    >>> sr.mpi_built()  # doctest: +SKIP
    True
    """
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def mpi_threads_supported() -> bool:
    """True when this ring runs on MPI and the MPI library takes calls from several
    threads at once (MPI_THREAD_MULTIPLE); False on gloo/nccl (MPI is never initialized
    just to answer).

    Returns:
        True only on an MPI ring whose library gives MPI_THREAD_MULTIPLE.

    >>> sr.mpi_threads_supported()  # doctest: +SKIP
    True
    """
    if _runtime.state.backend is None or _runtime.state.backend.name != "mpi":
        return False
    from ._mpi_backend import threads_supported

    return threads_supported()


def ccl_built() -> bool:
    """False: sparkring has no oneCCL transport.

    Returns:
        False.

    >>> sr.ccl_built()
    False
    """
    return False


def ddl_built() -> bool:
    """False: sparkring has no IBM DDL transport.

    Returns:
        False.

    >>> sr.ddl_built()
    False
    """
    return False


def cuda_built() -> bool:
    """True when this torch build has CUDA.

    Returns:
        True when torch was built with CUDA.

    >>> sr.cuda_built()  # doctest: +SKIP
    False
    """
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """True when this torch build has ROCm.

    Returns:
        True when torch was built with ROCm.

    >>> sr.rocm_built()  # doctest: +SKIP
    False
    """
    return getattr(torch.version, "hip", None) is not None


def mpi_enabled() -> bool:
    """True when this ring runs on MPI (Horovod: MPI used at run time).

    Returns:
        True when the ring runs on MPI.

    >>> sr.mpi_enabled()  # doctest: +SKIP
    False
    """
    return _runtime.state.backend is not None and _runtime.state.backend.name == "mpi"


def gloo_enabled() -> bool:
    """True when this ring runs on gloo.

    Returns:
        True when the ring runs on gloo.

    >>> sr.gloo_enabled()  # doctest: +SKIP
    True
    """
    return _runtime.state.backend is not None and _runtime.state.backend.name == "gloo"


def nccl_enabled() -> bool:
    """True when this ring runs on NCCL.

    Returns:
        True when the ring runs on NCCL.

    >>> sr.nccl_enabled()  # doctest: +SKIP
    False
    """
    return _runtime.state.backend is not None and _runtime.state.backend.name == "nccl"
