"""``horovod.spark.run`` and ``run_elastic`` with Horovod's signatures, over ``sparkring.run()``.

Every keyword Horovod takes is accepted; those that mean nothing here (``extra_mpi_args`` and
``nics`` on a ring sparkring wires itself, ``executable``: the executors run their own Python) are
said once in the log."""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO

from ..runner import RankOutput
from ..runner import run as sparkring_run

log = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT = 600  # Horovod's, when neither start_timeout nor HOROVOD_SPARK_START_TIMEOUT says
DEFAULT_RESET_LIMIT = 100  # Horovod's reset_limit=None is unbounded; a run that resets this often is broken


def _start_timeout(given: Optional[float]) -> float:
    return float(given if given is not None else os.environ.get("HOROVOD_SPARK_START_TIMEOUT", DEFAULT_START_TIMEOUT))


def say_ignored(**given: Any) -> None:
    """Log, once per call, the Horovod keywords that were set but mean nothing under sparkring."""
    reasons = {
        "extra_mpi_args": "sparkring starts the ranks itself, without mpirun",
        "nics": "the ranks reach each other at the addresses their executors have",
        "executable": "each rank runs in its executor's own Python",
        "mp_start_method": "sparkring decides how its processes start",
    }
    for name, value in given.items():
        if value is not None:
            log.info("%s=%r is accepted and not used: %s", name, value, reasons[name])


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[float] = None, use_mpi: Optional[bool] = None,
        use_gloo: Optional[bool] = None, extra_mpi_args: Optional[str] = None, env: Optional[Dict[str, str]] = None,
        stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None, verbose: int = 1,
        nics: Optional[Any] = None, prefix_output_with_timestamp: bool = False,
        executable: Optional[str] = None) -> List[Any]:
    """Horovod's ``horovod.spark.run``: ``fn(*args, **kwargs)`` on ``num_proc`` ranks (default: the
    session's default parallelism), one Spark task each; the results in rank order.

    ``start_timeout`` defaults to ``HOROVOD_SPARK_START_TIMEOUT`` or 600 s; ``env`` is added to the
    ranks' environment; ``stdout``/``stderr`` receive the ranks' output (with a time on each line
    where ``prefix_output_with_timestamp``).

    >>> import sparkring.collective as hvd
    >>> def fn():
    ...     hvd.init()
    ...     return hvd.rank()
    >>> run(fn, num_proc=2)  # doctest: +SKIP
    [0, 1]
    """
    say_ignored(extra_mpi_args=extra_mpi_args, nics=nics, executable=executable)
    return sparkring_run(fn, args=args, kwargs=kwargs, num_proc=num_proc, backend=_backend(use_mpi, use_gloo),
                         start_timeout=_start_timeout(start_timeout), env=env, verbose=verbose,
                         output=RankOutput(stdout, stderr, prefix_output_with_timestamp))


def run_elastic(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
                num_proc: Optional[int] = None, min_num_proc: Optional[int] = None,
                max_num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
                elastic_timeout: Optional[float] = None, reset_limit: Optional[int] = None,
                env: Optional[Dict[str, str]] = None, stdout: Optional[TextIO] = None,
                stderr: Optional[TextIO] = None, verbose: int = 1, nics: Optional[Any] = None,
                prefix_output_with_timestamp: bool = False, min_np: Optional[int] = None,
                max_np: Optional[int] = None) -> List[Any]:
    """Horovod's ``horovod.spark.run_elastic``: ``fn`` wraps its training in
    ``sparkring.collective.elastic.run``; a lost or failed rank makes the run launch again from the
    last ``state.commit()`` with at least ``min_num_proc`` ranks, at most ``reset_limit`` times.

    ``num_proc`` ranks start (``max_num_proc`` where given: the run grows back to it); a new launch
    waits up to ``elastic_timeout`` (else ``start_timeout``) for its slots.

    >>> run_elastic(fn, args=(2, 5, 4), num_proc=2, min_num_proc=2, max_num_proc=2)  # doctest: +SKIP
    """
    say_ignored(nics=nics)
    min_num_proc = min_np if min_np is not None else min_num_proc
    max_num_proc = max_np if max_np is not None else max_num_proc
    target = max_num_proc if max_num_proc is not None else num_proc
    if target is None:
        target = default_parallelism()
    minimum = min_num_proc if min_num_proc is not None else (num_proc if num_proc is not None else target)
    timeout = _start_timeout(start_timeout)
    if elastic_timeout is not None:
        timeout = max(timeout, float(elastic_timeout))
    return sparkring_run(fn, args=args, kwargs=kwargs, num_proc=target, min_proc=minimum, backend="auto",
                         max_restarts=DEFAULT_RESET_LIMIT if reset_limit is None else int(reset_limit),
                         start_timeout=timeout, env=env, verbose=verbose,
                         output=RankOutput(stdout, stderr, prefix_output_with_timestamp))


def default_parallelism() -> int:
    """Horovod's num_proc default: the session's default parallelism."""
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext
        return int(spark.conf.get("spark.default.parallelism", "2") or 2)


def _backend(use_mpi: Optional[bool], use_gloo: Optional[bool]) -> str:
    if use_mpi and use_gloo:
        from ..errors import ConfigurationError

        raise ConfigurationError("run(): use_mpi=True and use_gloo=True: pass one of them")
    return "mpi" if use_mpi else "gloo" if use_gloo else "auto"
