"""Horovod's ``horovod.spark.lightning``: ``TorchEstimator`` for a LightningModule (or a plain
module with an optimizer and loss) and ``TorchModel``, over sparkring's estimator.

>>> from sparkring.spark.lightning import TorchEstimator, TorchModel  # doctest: +SKIP
"""
from ..._lazy import lazy_exports

__all__ = ["TorchEstimator", "TorchModel"]

__getattr__, __dir__ = lazy_exports(__name__, {"TorchEstimator": "sparkring.spark.lightning.estimator",
                                               "TorchModel": "sparkring.spark.torch.estimator"}, globals(), __all__)
