"""The figures a rank adds up over an epoch, read by name: the figures tensor's layout and the time split.

A step's figures travel as one float64 tensor (summed on the device over the epoch's steps, then over
every rank in one allreduce): loss x rows, rows, then each named figure x rows (log_names' order).
``Totals`` reads such a tensor; ``TimeSplit`` is an epoch's seconds by part.
"""
from __future__ import annotations

import math
from dataclasses import astuple, dataclass, fields
from typing import Dict, List, Sequence, Tuple

import torch

LOSS, ROWS, FIRST_NAMED = 0, 1, 2  # positions in a figures tensor


def figures_tensor(loss_sum: torch.Tensor, rows: torch.Tensor, named_sums: Sequence[torch.Tensor]) -> torch.Tensor:
    """A step's figures as the one tensor the loop adds up (each value a 0-d tensor on one device).

    >>> figures_tensor(torch.tensor(3.0), torch.tensor(2.0), [torch.tensor(1.0)]).tolist()
    [3.0, 2.0, 1.0]
    """
    return torch.stack([loss_sum, rows, *named_sums])


def _ratio(total: float, rows: float) -> float:
    """total / rows as torch divides (no rows: nan, or an infinity of the total's sign)."""
    if rows:
        return total / rows
    return math.nan if total == 0 or math.isnan(total) else math.copysign(math.inf, total)


@dataclass(frozen=True)
class Totals:
    """A figures tensor summed over steps and ranks, read by name.

    >>> totals = Totals.of(torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64))
    >>> totals.loss, totals.means(["accuracy"])
    (1.5, {'accuracy': 0.5})
    """

    loss_sum: float
    rows: float
    named_sums: Tuple[float, ...]

    @classmethod
    def of(cls, sums: torch.Tensor) -> "Totals":
        """The totals a figures tensor holds (read on the host)."""
        values = sums.tolist()
        return cls(loss_sum=values[LOSS], rows=values[ROWS], named_sums=tuple(values[FIRST_NAMED:]))

    @property
    def loss(self) -> float:
        """The mean loss over the rows."""
        return _ratio(self.loss_sum, self.rows)

    def means(self, names: Sequence[str]) -> Dict[str, float]:
        """Each named figure's mean over the rows (``names``: log_names' order)."""
        return {name: _ratio(value, self.rows) for name, value in zip(names, self.named_sums)}


@dataclass(frozen=True)
class TimeSplit:
    """An epoch's training seconds on one rank by part: waiting for batches (data), forward, backward and
    the optimizer (compute), blocked in gradient exchanges (comm), the rest (other), and the total.

    >>> TimeSplit.from_values(TimeSplit(1.0, 2.0, 0.5, 0.5, 4.0).values()).compute
    2.0
    """

    data: float
    compute: float
    comm: float
    other: float
    total: float

    PARTS = ("data", "compute", "comm", "other")  # what the epoch lines and the history split the time into

    def values(self) -> List[float]:
        """The seconds in field order (one allreduce carries them)."""
        return list(astuple(self))

    @classmethod
    def from_values(cls, values: Sequence[float]) -> "TimeSplit":
        """A split from ``values()``' order."""
        return cls(*values[:len(fields(cls))])

    @classmethod
    def width(cls) -> int:
        """How many values ``values()`` gives."""
        return len(fields(cls))
