"""Horovod's ``Backend`` and ``SparkBackend``: how many processes an estimator trains with, and a
``run()`` that executes a function on them (``SparkBackend.run`` is ``sparkring.spark.run``).

sparkring's estimators launch their ranks themselves: from a Backend they take
``num_processes()`` (and a SparkBackend's ``start_timeout``); a custom Backend's ``run()`` is not
called by them."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence


class Backend:
    """Horovod's interface for where the training function runs.

    >>> class OneProcess(Backend):
    ...     def run(self, fn, args=(), kwargs={}, env=None):
    ...         return [fn(*args, **kwargs)]
    ...     def num_processes(self):
    ...         return 1
    """

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
            env: Optional[Dict[str, str]] = None) -> List[Any]:
        """Run ``fn`` on every process; the results in rank order."""
        raise NotImplementedError

    def num_processes(self) -> int:
        """How many processes train."""
        raise NotImplementedError


class SparkBackend(Backend):
    """Horovod's SparkBackend: ``num_proc`` ranks (default: the session's default parallelism) in
    Spark tasks; ``kwargs`` go to ``sparkring.spark.run``.

    >>> backend = SparkBackend(num_proc=2, start_timeout=60)  # doctest: +SKIP
    >>> backend.run(lambda: 1)  # doctest: +SKIP
    [1, 1]
    """

    def __init__(self, num_proc: Optional[int] = None, env: Optional[Dict[str, str]] = None, **kwargs: Any):
        from ..runner import default_parallelism

        self._num_proc = num_proc or default_parallelism()
        self._env = env
        self._kwargs = kwargs

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
            env: Optional[Dict[str, str]] = None) -> List[Any]:
        """``sparkring.spark.run(fn, ...)`` on this backend's processes, with its env and keywords."""
        from ..runner import run

        full_env = {**(self._env or {}), **(env or {})}
        return run(fn, args=args, kwargs=kwargs, num_proc=self._num_proc, env=full_env or None, **self._kwargs)

    def num_processes(self) -> int:
        """The ranks this backend runs."""
        return self._num_proc

    @property
    def start_timeout(self) -> Optional[float]:
        """The ``start_timeout`` given to this backend, if any."""
        value = self._kwargs.get("start_timeout")
        return None if value is None else float(value)
