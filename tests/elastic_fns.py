"""Models for the elastic-fit tests (importable by Spark's workers): a net that takes its time
per step (longer while fewer ranks than wanted train), and one whose rank process dies once at
a given step."""
import os
import time

import torch

import sparkring.collective as sr


class Paced(torch.nn.Module):
    """A small classifier whose training steps take ``seconds`` each, so that a test can act
    while an epoch runs."""

    def __init__(self, seconds: float = 0.0, d: int = 8, classes: int = 3, below: int = 0,
                 seconds_below: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.ReLU(), torch.nn.Linear(16, classes))
        # fewer than ``below`` ranks: ``seconds_below`` a step, time for a lost worker to come back
        self.seconds, self.below, self.seconds_below = seconds, below, seconds_below

    def forward(self, x):
        if self.training:
            pause = self.seconds_below if sr.size() < self.below else self.seconds
            if pause:
                time.sleep(pause)
        return self.net(x)


class DiesOnce(Paced):
    """Rank ``rank``'s process exits at its ``at``-th training step, the first time only (a
    marker file remembers): a lost rank, not an exception."""

    def __init__(self, marker: str, rank: int = 1, at: int = 10):
        super().__init__()
        self.marker, self.rank, self.at = marker, rank, at
        self.steps = 0

    def forward(self, x):
        if self.training:
            self.steps += 1
            if self.steps == self.at and sr.rank() == self.rank and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os._exit(3)
        return super().forward(x)
