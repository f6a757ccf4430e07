"""Where a rank's time and memory go: each epoch's seconds by part, and the bytes of training state it keeps."""
from __future__ import annotations

import time
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from sparkring.collective.timeline import recorder

from .figures import TimeSplit


class StepClock:
    """Where an epoch's seconds go on this rank: waiting for the next batch (data), forward,
    backward and the optimizer (compute), blocked in the gradient exchange (comm: replicated
    models, in backward where the transport reduces as it starts and in synchronize; FSDP2's
    exchanges run inside forward and backward and count as compute), the rest."""

    PARTS = ("data", "compute", "comm")

    def __init__(self) -> None:
        self.started = self.mark = time.monotonic()
        self.spent = dict.fromkeys(self.PARTS, 0.0)

    def lap(self, part: str) -> None:
        """Count the time since the last mark to ``part``."""
        now = time.monotonic()
        self.spent[part] += now - self.mark
        self.mark = now

    def exchanged(self, seconds: float) -> None:
        """``seconds`` of what was counted as compute were spent blocked in gradient exchanges."""
        self.spent["compute"] -= seconds
        self.spent["comm"] += seconds

    def timed(self, batches: Iterator[Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
        """``batches``, the time spent waiting for each counted as data time."""
        self.mark = time.monotonic()
        waited = recorder.now() if recorder.on else 0.0
        for batch in batches:
            self.lap("data")
            if recorder.on:
                recorder.add("data wait", waited, recorder.now())
            yield batch
            waited = recorder.now() if recorder.on else 0.0

    def seconds(self) -> TimeSplit:
        """The epoch's seconds so far, by part."""
        total = time.monotonic() - self.started
        other = max(0.0, total - sum(self.spent.values()))
        return TimeSplit(data=self.spent["data"], compute=self.spent["compute"], comm=self.spent["comm"], other=other,
                         total=total)


def state_bytes(model: torch.nn.Module, opt: Optional[torch.optim.Optimizer]) -> Tuple[int, int]:
    """Bytes this rank keeps between steps: (parameters + optimizer state, gradients), as the
    sizes of the storages behind them, each counted once (DistributedOptimizer's gradients share
    bucket buffers; a DTensor counts its local shard). Storages are what the allocator holds,
    unlike RSS, which the interpreter, torch and the data also move. FSDP2's gathered copy of
    the layer being computed is transient (freed after its forward and backward) and not counted.

    >>> m = torch.nn.Linear(4, 2)
    >>> state_bytes(m, None)
    (40, 0)
    >>> e = torch.nn.Embedding(10, 4, sparse=True)
    >>> e(torch.tensor([1, 2])).sum().backward()
    >>> state_bytes(e, None)  # the weight, and a sparse gradient of 2 rows and their indices
    (160, 48)
    """
    seen: set = set()

    def size(t: Optional[torch.Tensor]) -> int:
        if t is None:
            return 0
        if t.layout == torch.sparse_coo:  # sparse embedding gradients: their values and indices
            return size(t._values()) + size(t._indices())
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    kept = sum(size(p) for p in model.parameters())
    if opt is not None:
        kept += sum(size(v) for state in opt.state.values() for v in state.values()
                    if torch.is_tensor(v) and v.dim() > 0)
    grads = sum(size(p.grad) for p in model.parameters())
    return kept, grads
