"""Models for the elastic-fit tests (importable by Spark's workers): a net that takes its time
per step (longer while fewer ranks than wanted train), and one whose rank process dies once at
a given step; either can write down the row ids each training step of each rank process saw
(``audit``: a directory, one file per process, a line per step)."""
import os
import time

import torch

import sparkring.collective as sr


class Paced(torch.nn.Module):
    """A small classifier whose training steps take ``seconds`` each, so that a test can act
    while an epoch runs."""

    def __init__(self, seconds: float = 0.0, d: int = 8, classes: int = 3, below: int = 0,
                 seconds_below: float = 0.0, audit: str = None):
        super().__init__()
        self.audit = audit
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.ReLU(), torch.nn.Linear(16, classes))
        # fewer than ``below`` ranks: ``seconds_below`` a step, time for a lost worker to come back
        self.seconds, self.below, self.seconds_below = seconds, below, seconds_below

    def forward(self, x, row_id=None):
        if self.training and self.audit is not None:
            with open(os.path.join(self.audit, f"{os.getpid()}.txt"), "a") as f:
                f.write(f"{time.time()} {' '.join(str(int(i)) for i in row_id.view(-1))}\n")
        if self.training:
            pause = self.seconds_below if sr.size() < self.below else self.seconds
            if pause:
                time.sleep(pause)
        return self.net(x)


class DiesOnce(Paced):
    """Rank ``rank``'s process exits at its ``at``-th training step, the first time only (a
    marker file remembers): a lost rank, not an exception."""

    def __init__(self, marker: str, rank: int = 1, at: int = 10, audit: str = None):
        super().__init__(audit=audit)
        self.marker, self.rank, self.at = marker, rank, at
        self.steps = 0

    def forward(self, x, row_id=None):
        if self.training:
            self.steps += 1
            if self.steps == self.at and sr.rank() == self.rank and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os._exit(3)
        return super().forward(x, row_id)
