"""sparkring: PyTorch training on Spark DataFrames (data, tensor and pipeline parallel) and Horovod's API inside ranks.

>>> from sparkring import SparkRingEstimator, SparkRingModel, Store, run
"""
from ._lazy import lazy_exports
from .errors import (
    ChannelError,
    ConfigurationError,
    DataError,
    HorovodInternalError,
    HostLostError,
    HostsUpdatedInterrupt,
    MismatchError,
    NonFiniteLossError,
    NotInitializedError,
    RankFailedError,
    RankTimeoutError,
    SparkRingError,
    StageLostError,
    StoreError,
    TrainingError,
)

__all__ = ["SparkRingEstimator", "SparkRingModel", "Store", "run", "doctor", "TorchDistributor", "SparkRingError",
           "ConfigurationError", "DataError", "StoreError", "RankFailedError", "RankTimeoutError",
           "NotInitializedError", "HorovodInternalError", "MismatchError", "ChannelError", "TrainingError",
           "StageLostError", "HostLostError", "HostsUpdatedInterrupt", "NonFiniteLossError", "spark"]
__version__ = "0.1.0"

# Imported on first use: a rank's worker process imports sparkring.collective and should
# not pay for pyspark.ml, pandas and pyarrow it never touches.
_LAZY = {
    "SparkRingEstimator": "sparkring.estimator",
    "SparkRingModel": "sparkring.estimator",
    "Store": "sparkring.data",
    "run": "sparkring.runner",
    "doctor": "sparkring.runner.driver.doctor",
    "TorchDistributor": "sparkring.runner.driver.distributor",
    "spark": "sparkring.spark",  # Horovod's horovod.spark, for `import sparkring as horovod`
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
