"""SparkRingEstimator / SparkRingModel: pyspark.ml stages around the per-rank training loop.

>>> from sparkring.estimator import SparkRingEstimator, SparkRingModel
"""
from .estimator import SparkRingEstimator
from .model import SparkRingModel

__all__ = ["SparkRingEstimator", "SparkRingModel"]
