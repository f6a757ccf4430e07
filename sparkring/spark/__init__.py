"""Horovod's ``horovod.spark`` over sparkring: ``run``, ``run_elastic``, ``torch.TorchEstimator`` and
``TorchModel``, ``lightning.TorchEstimator``, ``common.store`` and ``common.backend``, so a
Horovod-on-Spark pipeline runs with only its imports changed.

A translation layer: Horovod's names and semantics map onto sparkring's ``run()`` and
``SparkRingEstimator`` (no second launcher, no second trainer).

>>> import sparkring as horovod
>>> horovod.spark.run(fn, num_proc=2)  # doctest: +SKIP
[0, 0]
"""
from .._lazy import lazy_exports
from .runner import run, run_elastic

__all__ = ["run", "run_elastic"]

# horovod.spark.torch and the rest, reachable as attributes (imported on first use)
__getattr__, __dir__ = lazy_exports(__name__, {name: f"{__name__}.{name}" for name in ("torch", "lightning", "common")},
                                    globals(), __all__)
