"""An LR scheduler and when it steps (each epoch or each update, every few, on a monitored figure)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch


@dataclass
class Schedule:
    """One LR scheduler as configure_optimizers described it.

    >>> opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    >>> Schedule(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)).step(); opt.param_groups[0]["lr"]
    0.5
    """

    scheduler: Any
    interval: str = "epoch"   # "epoch" | "step"
    frequency: int = 1
    monitor: Optional[str] = None

    def step(self, logs: Optional[Dict[str, Any]] = None) -> None:
        """Step the scheduler (a plateau rule reads its monitored figure from ``logs``)."""
        if self.monitor is not None or _is_plateau(self.scheduler):
            monitor = self.monitor or "val_loss"
            if logs is None or monitor not in logs:
                raise ValueError(f"the LR scheduler {type(self.scheduler).__name__} monitors {monitor!r}, which this "
                                 f"epoch does not log (it has {sorted(logs or {})}); set 'monitor' in "
                                 "configure_optimizers to one of those")
            self.scheduler.step(logs[monitor])
        else:
            self.scheduler.step()


def _is_plateau(scheduler: Any) -> bool:
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
