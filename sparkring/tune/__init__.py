"""Hyperparameter search: ``Tuner`` runs an Optuna study's trials as concurrent fits of a
SparkRingEstimator, pruned at epoch ends (``pip install 'sparkring[tune]'``)."""
from .trials import TrialRecord
from .tuner import Tuner, TuneResult

__all__ = ["Tuner", "TuneResult", "TrialRecord"]
