"""Where a fit's wall time went, phase by phase: planning and preparing the data on the driver,
launching the ranks, their first step, the epochs, and bringing the result back."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Optional

from ..trainer.events import EpochDone, FitBegan, StepDone, TrainingEvent


@dataclass(frozen=True)
class FitPhases:
    """Seconds of each phase of one fit() (``model.phases``); they add up to its wall time.

    >>> FitPhases(plan=0.4, launch=1.1, first_step=0.2, epochs=5.0, result=0.3).total
    7.0
    """

    plan: float = 0.0        # checks, the launch plan and the data (prepared, or planned in place)
    launch: float = 0.0      # the barrier stage until rank 0 begins training (model built, resumed)
    first_step: float = 0.0  # rank 0's first step (it compiles with compile=True)
    epochs: float = 0.0      # the rest of training, every epoch's end and checkpoint included
    result: float = 0.0      # rank 0's weights back on the driver, the fitted model built

    @property
    def total(self) -> float:
        """Seconds of the whole fit: the phases summed."""
        return round(self.plan + self.launch + self.first_step + self.epochs + self.result, 6)

    def line(self) -> str:
        """'plan 0.4s, launch 1.1s, first step 0.2s, epochs 5.0s, result 0.3s'."""
        return (f"plan {self.plan:.1f}s, launch {self.launch:.1f}s, first step {self.first_step:.1f}s, "
                f"epochs {self.epochs:.1f}s, result {self.result:.1f}s")


class PhaseClock:
    """Marks the phases as a fit goes: ``launching()`` when the data is ready, rank 0's events
    (a listener, as the console's), ``phases()`` at the end. A relaunched elastic fit keeps its
    first launch's marks: later launches count as epochs.

    >>> clock = PhaseClock(); clock.launching(); clock.phases().plan >= 0
    True
    """

    def __init__(self) -> None:
        self.marks: Dict[str, float] = {"start": time.perf_counter()}

    def launching(self) -> None:
        """Mark the launch's start (the first call counts)."""
        self.marks.setdefault("launch", time.perf_counter())

    def __call__(self, rank: int, event: TrainingEvent) -> None:
        """Mark when rank 0 began, stepped first and ended an epoch."""
        if rank != 0:
            return
        name: Optional[str] = {FitBegan: "began", StepDone: "first_step", EpochDone: "last_epoch"}.get(type(event))
        if name == "last_epoch":
            self.marks["last_epoch"] = time.perf_counter()
        elif name is not None:
            self.marks.setdefault(name, time.perf_counter())

    def phases(self) -> FitPhases:
        """The phases' seconds, up to now for those not ended."""
        end = time.perf_counter()
        at = self.marks
        launch = at.get("launch", end)
        began = at.get("began", launch)
        first = at.get("first_step", began)
        last = max(at.get("last_epoch", first), first)
        return FitPhases(plan=launch - at["start"], launch=began - launch, first_step=first - began,
                         epochs=last - first, result=end - last)
