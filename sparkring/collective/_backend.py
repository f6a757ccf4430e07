"""The small interface every collective backend implements (torch.distributed, MPI)."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch


class Handle(abc.ABC):
    """An in-flight asynchronous collective; ``wait()`` returns its output tensor."""

    @abc.abstractmethod
    def wait(self) -> torch.Tensor: ...

    @abc.abstractmethod
    def is_completed(self) -> bool: ...


@dataclass
class RingHealth:
    """Whether a collective of a ring saw a peer rank go away (its transport said so): shared
    by the ring, its process sets and its handles."""

    peer_lost: bool = False


class Backend(abc.ABC):
    """What the public API needs from a transport. All tensor ops work on CPU or the
    backend's device; ``op`` is one of "sum", "min", "max", "product"."""

    name: str
    rank: int
    size: int

    @abc.abstractmethod
    def allreduce_async(self, tensor: torch.Tensor, op: str) -> Handle:
        """Reduce ``tensor`` in place across ranks; returns a handle."""

    def allreduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Blocking in-place allreduce (every rank calls the blocking flavour together)."""
        return self.allreduce_async(tensor, op).wait()

    def out_of_place_applies(self, tensor: torch.Tensor) -> bool:
        """True when ``allreduce_new`` can reduce the contiguous ``tensor`` into a new tensor
        without copying it first (every rank decides the same from shape and dtype)."""
        return False

    def result_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """An uninitialized contiguous tensor shaped like ``tensor`` to return a result in."""
        return torch.empty_like(tensor, memory_format=torch.contiguous_format)

    def allreduce_new(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Blocking out-of-place allreduce; only called where ``out_of_place_applies``."""
        raise NotImplementedError

    @abc.abstractmethod
    def allgather_same_shape(self, tensor: torch.Tensor) -> List[torch.Tensor]: ...

    @abc.abstractmethod
    def broadcast_async(self, tensor: torch.Tensor, root_rank: int) -> Handle:
        """Overwrite ``tensor`` in place with root's copy; returns a handle."""

    @abc.abstractmethod
    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor]) -> None: ...

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None: ...

    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> None: ...

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root_rank: int) -> Any: ...

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> List[Any]: ...

    @abc.abstractmethod
    def barrier(self) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    def rendezvous(self) -> Optional[Any]:
        """The key-value store every rank of this ring reaches (None for a ring of one)."""
        return None

    def peer_lost(self) -> bool:
        """True once a collective of this ring raised HorovodInternalError because a peer rank
        went away: no ring of the same ranks forms again, so leaving it hands no port over."""
        return False

    def join_stores(self) -> Optional[Tuple[Any, Any]]:
        """Two connections to a key-value store every rank reaches (the second one for a
        thread that blocks on it), or None when ``join()`` has nothing to coordinate."""
        return None

    def subgroup(self, ranks: List[int]) -> Optional["Backend"]:
        """The ring of ``ranks`` only, for a process set (every rank calls it; None on ranks
        outside). Transports without subgroups say so."""
        raise NotImplementedError(f"process sets are not supported on backend={self.name!r} yet; use gloo or nccl")

    def release(self) -> None:  # noqa: B027 - nothing to let go of unless a subgroup holds resources
        """Let go of a subgroup made by ``subgroup`` (its process set is being removed)."""

    def group_rank(self, global_rank: int) -> int:
        """Where global rank ``global_rank`` stands in this ring (a process set's ring is a subset)."""
        return global_rank

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a tensor of ``dtype`` travels in (a wider one where the transport lacks it)."""
        return dtype

    @property
    def device(self) -> Optional[torch.device]:
        """Where tensors must live for this backend (None: anywhere on CPU)."""
        return None
