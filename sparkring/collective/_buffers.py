"""Result tensors for out-of-place collectives, handed out again once callers drop them."""
from __future__ import annotations

import collections
from typing import Deque

import torch

POOL_MIN_BYTES = 256 * 1024  # smaller allocations come from malloc's free lists anyway


class ResultBuffers:
    """Result tensors handed out again once the caller dropped every reference to them.

    A fresh multi-MB CPU tensor pays one page fault per 4 KB page on first write, which
    costs about as much as the reduction itself; like CUDA's caching allocator, reusing
    a dead result's memory avoids that. Bounded in count and bytes."""

    def __init__(self, max_buffers: int = 8, max_bytes: int = 512 * 1024 * 1024):
        self._storages: Deque[torch.UntypedStorage] = collections.deque()
        self._max_buffers = max_buffers
        self._max_bytes = max_bytes

    _use_count = getattr(torch._C, "_storage_Use_Count", None)  # private; absent: never reuse

    @classmethod
    def _free(cls, storage: torch.UntypedStorage) -> bool:
        return cls._use_count is not None and cls._use_count(storage._cdata) == 1  # only ours is left

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        for storage in self._storages:
            if storage.nbytes() == nbytes and self._free(storage):
                return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))
        fresh = torch.empty(numel, dtype=dtype)
        if nbytes <= self._max_bytes:
            self._storages.append(fresh.untyped_storage())
            while (len(self._storages) > self._max_buffers
                   or sum(s.nbytes() for s in self._storages) > self._max_bytes):
                self._storages.popleft()
        return fresh

    def like(self, tensor: torch.Tensor) -> torch.Tensor:
        """An uninitialized contiguous tensor shaped like ``tensor``, reused where it pays."""
        if tensor.device.type != "cpu" or tensor.numel() * tensor.element_size() < POOL_MIN_BYTES:
            return torch.empty_like(tensor, memory_format=torch.contiguous_format)
        return self.get(tensor.numel(), tensor.dtype).view(tensor.shape)
