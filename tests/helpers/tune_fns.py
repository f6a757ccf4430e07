"""Spaces, optimizers and models for the Tuner tests (importable by Spark's workers)."""
import functools
import os

import torch
from est_helpers import ForwardFails

# the learning rates trials 0.. fit with, in order: three that train, then three that diverge
RATES = [0.01, 0.03, 0.02, 30.0, 40.0, 50.0]


def adam_at(lr, params):
    return torch.optim.Adam(params, lr=lr)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def rates_in_order(trial, rates=tuple(RATES), failing=None):
    """Trial n fits with rates[n] (recorded as its "lr"); trial ``failing`` with a model that raises."""
    lr = rates[trial.number]
    trial.suggest_float("lr", lr, lr)
    params = {"optimizer": functools.partial(adam_at, lr)}
    if trial.number == failing:
        params["model"] = ForwardFails
    return params


def interrupted_at(marker, number):
    """A space that interrupts the tuner (as Ctrl-C would) when trial ``number`` begins, once."""
    def space(trial):
        if trial.number == number and not os.path.exists(marker):
            open(marker, "w").close()
            raise KeyboardInterrupt
        return rates_in_order(trial)
    return space
