"""SparkRingEstimator / SparkRingModel: pyspark.ml stages around the per-rank training loop.

>>> from sparkring.estimator import SparkRingEstimator, SparkRingModel
"""
from typing import Any

__all__ = ["SparkRingEstimator", "SparkRingModel"]

# Imported on first use: a rank process imports sparkring.estimator.training (its loop), which
# must not pay for pyspark.ml (half a second) that only the driver's stages use.
_LAZY = {"SparkRingEstimator": "sparkring.estimator.estimator", "SparkRingModel": "sparkring.estimator.model"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sparkring.estimator' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
