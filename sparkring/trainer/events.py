"""The training loop's progress as types: what rank 0 reports while it trains, and what the
driver's listeners (the console, the MLflow tracker) receive. They travel as the payload of the
runner's Event frame (JSON); this module is their one encoding."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Union


@dataclass(frozen=True)
class FitBegan:
    """Training starts (``start_epoch`` > 0: resumed from a checkpoint)."""

    epochs: int
    start_epoch: int
    steps: int


@dataclass(frozen=True)
class StepDone:
    """A step of an epoch ended; ``loss`` is the epoch's running mean on rank 0."""

    epoch: int
    step: int
    steps: int
    loss: float


@dataclass(frozen=True)
class EpochDone:
    """An epoch ended: its figures over every rank (``logs``, as in model.history), and whether
    early stopping ends the fit here."""

    epoch: int
    logs: Dict[str, Any] = field(default_factory=dict)
    stopped: bool = False


@dataclass(frozen=True)
class LinkMeasured:
    """A host's link to the driver measured by its first rank (trainer.link_probe), one of
    ``hosts``."""

    host: str
    bytes_per_second: float
    hosts: int


TrainingEvent = Union[FitBegan, StepDone, EpochDone, LinkMeasured]
_KINDS = {"begin": FitBegan, "step": StepDone, "epoch": EpochDone, "link": LinkMeasured}
_NAMES = {cls: name for name, cls in _KINDS.items()}


def to_payload(event: TrainingEvent) -> Dict[str, Any]:
    """The JSON object an event travels as.

    >>> to_payload(StepDone(epoch=0, step=3, steps=10, loss=0.5))
    {'kind': 'step', 'epoch': 0, 'step': 3, 'steps': 10, 'loss': 0.5}
    """
    return {"kind": _NAMES[type(event)], **asdict(event)}


def from_payload(payload: Any) -> Optional[TrainingEvent]:
    """The training event a payload holds; None for anything else (a user's own report()).

    >>> from_payload({"kind": "epoch", "epoch": 1, "logs": {"loss": 0.2}})
    EpochDone(epoch=1, logs={'loss': 0.2}, stopped=False)
    >>> from_payload({"loss": 0.3}) is None
    True
    """
    if not isinstance(payload, dict):
        return None
    cls = _KINDS.get(payload.get("kind", ""))
    if cls is None:
        return None
    try:
        return cls(**{k: v for k, v in payload.items() if k != "kind"})
    except TypeError:
        return None
