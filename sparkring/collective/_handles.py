"""Handles of asynchronous collectives as the public API returns them."""
from __future__ import annotations

from typing import Any, Optional

import torch

from ._backend import Handle


class PostHandle(Handle):
    """A backend handle plus what to do with its result: scale, decompress, copy out."""

    def __init__(self, inner: Handle, finish):
        self._inner = inner
        self._finish = finish
        self._result: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._finish(self._inner.wait())
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None or self._inner.is_completed()


class DoneHandle(Handle):
    """An operation that finished when it was issued (empty tensors, blocking paths)."""

    def __init__(self, result: Any):  # a tensor, or a list/tuple of them (grouped, with splits)
        self._result = result

    def wait(self):
        return self._result

    def is_completed(self):
        return True
