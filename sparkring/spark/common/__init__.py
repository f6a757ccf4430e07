"""Horovod's ``horovod.spark.common``: ``store``, ``backend``, ``util`` and ``constants``."""
from ..._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {name: f"{__name__}.{name}"
                                               for name in ("store", "backend", "util", "constants")}, globals(), [])
