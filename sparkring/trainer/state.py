"""The training loop's part of a checkpoint (TrainerState), typed in memory and a plain dict on storage."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class TrainerState:
    """Where the loop was when a checkpoint was written: after ``epoch`` (or inside it, before
    ``step``, with ``epoch_sums``: every rank's figures so far), the history, early stopping's
    (best, epochs waited) and each LR scheduler's state. On storage it is a dict of numbers, strings
    and tensors (``to_dict``), which loads without unpickling code.

    >>> state = TrainerState(epoch=1, history=[{"loss": 0.5}], seed=0, stopped=False)
    >>> TrainerState.from_dict(state.to_dict()) == state
    True
    """

    epoch: int
    history: List[Dict[str, Any]]
    seed: int
    stopped: bool
    early_stopping: Tuple[Optional[float], int] = (None, 0)
    schedulers: List[Dict[str, Any]] = field(default_factory=list)
    step: Optional[int] = None             # saved inside the epoch: the step to go on at
    epoch_sums: Optional[List[float]] = None

    def to_dict(self) -> Dict[str, Any]:
        """The dict a checkpoint file (or a DCP checkpoint's trainer file) holds."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, saved: Dict[str, Any]) -> "TrainerState":
        """The state a checkpoint holds (those of earlier versions lack the later keys)."""
        best, waited = saved.get("early_stopping", (None, 0))
        return cls(epoch=int(saved["epoch"]), history=list(saved["history"]), seed=int(saved.get("seed", 0)),
                   stopped=bool(saved.get("stopped")), early_stopping=(best, int(waited)),
                   schedulers=list(saved.get("schedulers", [])),
                   step=None if saved.get("step") is None else int(saved["step"]),
                   epoch_sums=None if saved.get("epoch_sums") is None else list(saved["epoch_sums"]))

    @property
    def inside_epoch(self) -> bool:
        """Saved inside an epoch (checkpointEvery, or an elastic fit asked to leave), not at its end."""
        return self.step is not None
