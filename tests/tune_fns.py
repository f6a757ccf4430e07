"""Spaces, optimizers and models for the Tuner tests (importable by Spark's workers)."""
import functools
import os

import torch

# the learning rates trials 0.. fit with, in order: three that train, then three that diverge
RATES = [0.01, 0.03, 0.02, 30.0, 40.0, 50.0]


def adam_at(lr, params):
    return torch.optim.Adam(params, lr=lr)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


class Raises(torch.nn.Module):
    """A model whose forward raises: its trial fails."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 3)

    def forward(self, x):
        raise RuntimeError("this trial's model is broken")


def rates_in_order(trial, rates=tuple(RATES), failing=None):
    """Trial n fits with rates[n] (recorded as its "lr"); trial ``failing`` with a model that raises."""
    lr = rates[trial.number]
    trial.suggest_float("lr", lr, lr)
    params = {"optimizer": functools.partial(adam_at, lr)}
    if trial.number == failing:
        params["model"] = Raises
    return params


def interrupted_at(marker, number):
    """A space that interrupts the tuner (as Ctrl-C would) when trial ``number`` begins, once."""
    def space(trial):
        if trial.number == number and not os.path.exists(marker):
            open(marker, "w").close()
            raise KeyboardInterrupt
        return rates_in_order(trial)
    return space
