"""The executors' interpreter, looked at once per application before any rank starts: an executor
whose Python cannot import sparkring (or cannot run this driver's Python tasks at all) is named
with its fix in one line instead of failing deep inside the barrier stage. One plain-Python task,
its function shipped by value, so it runs where sparkring is missing; other versions than the
driver's are compared on every executor by the barrier stage's first rendezvous (versions.py)."""
from __future__ import annotations

import json
import logging
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from ...errors import ConfigurationError
from .. import _probe
from ..versions import COMPARED
from .session import JobTag, is_connect

log = logging.getLogger(__name__)

SHIP_FIX = ("on a cluster, give the executors an environment with sparkring: a packed virtualenv (make pack) "
            "through spark.archives and PYSPARK_PYTHON=./environment/bin/python (docs/clusters.md)")


@dataclass(frozen=True)
class ExecutorInterpreter:
    """What an executor runs Python tasks with: its interpreter and the versions it imports, or
    why a plain Python task could not run there (``failure``: Spark's first line).

    >>> ExecutorInterpreter("/usr/bin/python3", {"sparkring": "missing"}).problem().what
    "the executors' Python, /usr/bin/python3, cannot import sparkring"
    """

    executable: str
    versions: Dict[str, str]
    failure: str = ""

    def problem(self) -> Optional["InterpreterProblem"]:
        """Why a fit cannot start on these executors, and the fix; None where it can."""
        here = (f"set PYSPARK_PYTHON={sys.executable} (this driver's interpreter) before the SparkSession starts, "
                f"or spark.pyspark.python; {SHIP_FIX}")
        if self.failure:
            return InterpreterProblem(f"the executors cannot run this driver's Python tasks ({self.failure})", here)
        found = self.versions.get("sparkring", "missing")
        if found == "missing" or found.startswith("broken"):
            cannot = "cannot import sparkring" if found == "missing" else f"has a sparkring that is {found}"
            return InterpreterProblem(f"the executors' Python, {self.executable}, {cannot}", here)
        return None


@dataclass(frozen=True)
class InterpreterProblem:
    """What keeps the executors' Python from running the ranks, and the fix (``str()``: both, one line)."""

    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}: {self.fix}"


_looked_at: Dict[str, ExecutorInterpreter] = {}


def executor_interpreter(spark, timeout: float) -> Optional[ExecutorInterpreter]:
    """One executor's interpreter, from a one-row Python UDF (once per application); None where
    the task did not finish within ``timeout`` seconds (the launch then finds out itself)."""
    key = _application(spark)
    if key in _looked_at:
        return _looked_at[key]
    found: Dict[str, object] = {}
    tag = JobTag(spark, f"sparkring-python-{uuid.uuid4().hex[:8]}", "sparkring: the executors' Python")

    def look() -> None:
        from pyspark.sql.functions import udf

        try:
            with tag:
                probe = udf(_probe.interpreter_probe(tuple(COMPARED)), "string", useArrow=False)
                found["row"] = spark.range(0, 1, 1, 1).select(probe("id").alias("facts")).first()
        except Exception as exc:  # noqa: BLE001 - Spark's own failure is the finding
            found["error"] = exc

    thread = probe_thread(look, "sparkring-executor-python", timeout)
    if thread.is_alive():
        tag.cancel()
        log.info("the executors' Python was not looked at: its task did not finish within %g s", timeout)
        return None
    result = _interpreter(found)
    if result is not None and key:
        _looked_at[key] = result
    return result


def _interpreter(found: Dict[str, object]) -> Optional[ExecutorInterpreter]:
    if "row" in found:
        facts = json.loads(found["row"]["facts"])  # type: ignore[index]
        return ExecutorInterpreter(facts["executable"], facts["versions"])
    text = str(found.get("error", "")).strip()
    first = next((line.strip() for line in text.splitlines()
                  if "PYTHON_VERSION_MISMATCH" in line or "different version" in line
                  or "ModuleNotFoundError" in line or "No module named" in line), "")
    if first:
        return ExecutorInterpreter("?", {}, failure=first)
    log.info("the executors' Python was not looked at: %s", text.splitlines()[0] if text else "no answer")
    return None


def _application(spark) -> str:
    try:
        return spark.conf.get("spark.app.id", "") if is_connect(spark) else spark.sparkContext.applicationId
    except Exception:  # noqa: BLE001 - a session that cannot say: looked at every time
        return ""


def check_executor_interpreter(spark, timeout: float) -> None:
    """Refuse to launch where the executors' Python cannot run the ranks (before any rank starts).

    >>> check_executor_interpreter(spark, timeout=120)  # doctest: +SKIP
    Traceback (most recent call last):
    ConfigurationError: the executors' Python, /usr/bin/python3, cannot import sparkring: set PYSPARK_PYTHON=...
    """
    found = executor_interpreter(spark, timeout)
    problem = found.problem() if found is not None else None
    if problem is not None:
        raise ConfigurationError(str(problem))


def probe_thread(job: Callable[[], None], name: str, timeout: float) -> threading.Thread:
    """Run ``job`` (a Spark job of ``_probe``'s functions) on a daemon thread, ``_probe`` pickled
    by value (the executors may lack sparkring), waiting up to ``timeout``: the thread, still
    alive where the job ran past it.

    >>> probe_thread(lambda: None, "sparkring-probe", 5.0).is_alive()
    False
    """
    from pyspark import cloudpickle as spark_cloudpickle

    spark_cloudpickle.register_pickle_by_value(_probe)
    try:
        thread = threading.Thread(target=job, name=name, daemon=True)
        thread.start()
        thread.join(timeout)
    finally:
        spark_cloudpickle.unregister_pickle_by_value(_probe)
    return thread
