"""Horovod's ``horovod.spark.torch``: ``TorchEstimator`` and ``TorchModel`` over sparkring's estimator.

>>> from sparkring.spark.torch import TorchEstimator, TorchModel  # doctest: +SKIP
"""
from ..._lazy import lazy_exports

__all__ = ["TorchEstimator", "TorchModel"]

# the ranks unpickle this package's losses: importing them loads no pyspark.ml
__getattr__, __dir__ = lazy_exports(__name__, {name: "sparkring.spark.torch.estimator" for name in __all__},
                                    globals(), __all__)
