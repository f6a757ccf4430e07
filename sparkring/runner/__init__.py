"""Launch ranks as a Spark barrier stage: ``run(fn, num_proc=2)``.

>>> from sparkring.runner import run
>>> run(lambda: 42, num_proc=2)  # doctest: +SKIP
[42, 42]
"""
from .channel import report
from .errors import ConfigurationError, RankFailedError, RankTimeoutError, SparkRingError
from .launch import run

__all__ = ["run", "report", "ConfigurationError", "RankFailedError", "RankTimeoutError", "SparkRingError"]
