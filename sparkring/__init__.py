"""sparkring: synchronous data-parallel PyTorch training on Spark DataFrames.

>>> from sparkring import SparkRingEstimator, SparkRingModel, Store, run
"""
from .data import Store
from .estimator import SparkRingEstimator, SparkRingModel
from .runner import ConfigurationError, RankFailedError, RankTimeoutError, run

__version__ = "0.1.0"
__all__ = ["SparkRingEstimator", "SparkRingModel", "Store", "run", "ConfigurationError", "RankFailedError",
           "RankTimeoutError"]
