"""SparkRingEstimator / SparkRingModel: pyspark.ml stages around the per-rank training loop.

>>> from sparkring.estimator import SparkRingEstimator, SparkRingModel
"""
from .._lazy import lazy_exports

__all__ = ["SparkRingEstimator", "SparkRingModel"]

# Imported on first use: importing the package must not pay for pyspark.ml (half a second) before a
# stage is used (the CLI, run() and the rank side, sparkring.trainer, never use one).
_LAZY = {"SparkRingEstimator": "sparkring.estimator.estimator", "SparkRingModel": "sparkring.estimator.model"}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
