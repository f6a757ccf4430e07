"""``sparkring.doctor(spark)`` / ``python -m sparkring doctor``: one short barrier stage on the
session's cluster that reports, per executor, what a fit needs (versions as the driver's, task
slots, GPUs, /dev/shm, MPI, NCCL, the way back to the driver), then one verdict per problem
with its fix."""
from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from ...data.store import Store
from .. import _probe
from ..versions import package_versions, skew
from .interpreter import executor_interpreter, probe_thread
from .resources import default_ranks_per_task
from .session import JobTag, session_facts, settled_slots

log = logging.getLogger(__name__)

# what the shared-memory allreduce maps per local rank (3 areas of 2 MiB chunks, with room to spare)
_SHM_PER_RANK = 16 * 1024 * 1024
_SHIP_FIX = ("ship the driver's environment: a packed virtualenv (make pack) with "
             "spark.archives=sparkring-env.tar.gz#environment and spark.pyspark.python=./environment/bin/python")


@dataclass(frozen=True)
class Problem:
    """One finding and its fix; ``fatal`` ones would break a fit."""

    where: str
    what: str
    fix: str
    fatal: bool

    def __str__(self) -> str:
        return f"{'PROBLEM' if self.fatal else 'warning'}: {self.where}: {self.what}. Fix: {self.fix}"


@dataclass
class ExecutorReport:
    """An executor as its tasks found it (``tasks``: the slots it ran at once)."""

    executor: str
    facts: _probe.TaskFacts
    tasks: int
    gpus_assigned: List[str] = field(default_factory=list)


@dataclass
class DoctorReport:
    """What ``doctor`` found; ``ok`` is False when a fit would break. ``str()`` is the report.

    >>> report = sparkring.doctor(spark)  # doctest: +SKIP
    >>> print(report); report.ok  # doctest: +SKIP
    """

    master: str
    driver_versions: Dict[str, str]
    slots_wanted: int
    executors: List[ExecutorReport]
    problems: List[Problem]
    gpus_per_task: float = 0.0      # spark.task.resource.gpu.amount
    ranks_per_task: int = 1         # what a fit with GPUs runs in each task by default


    @property
    def ok(self) -> bool:
        """Whether nothing fatal was found."""
        return not any(p.fatal for p in self.problems)

    def __str__(self) -> str:
        d = self.driver_versions
        lines = [f"sparkring doctor: master {self.master}, {self.slots_wanted} task slot(s) in one barrier stage",
                 f"{self.gpus_per_task:g} GPU(s) per task: {self.ranks_per_task} rank(s) per task by default",
                 "driver: " + ", ".join(f"{k} {v}" for k, v in d.items())]
        for e in self.executors:
            f = e.facts
            shm = f"{f.shm_free_bytes / 2**20:.0f} MiB free" if f.shm_free_bytes is not None else "none"
            gpus = (f"assigned {','.join(e.gpus_assigned) or '-'}, torch sees "
                    f"{'-' if f.gpus_visible is None else f.gpus_visible}, nccl {'yes' if f.nccl else 'no'}")
            lines.append(f"executor {e.executor} ({f.hostname}): {e.tasks} task(s), {f.cpu_count} cores, "
                         f"python {f.python_executable}")
            lines.append("  " + ", ".join(f"{k} {v}" for k, v in f.versions.items()))
            lines.append(f"  GPUs: {gpus}; /dev/shm: {shm}; mpiexec: {f.mpiexec or 'missing'}, "
                         f"mpi4py: {'yes' if f.mpi4py else 'missing'}; driver "
                         + ("reachable" if f.driver_reachable else f"NOT reachable ({f.driver_error})"))
        lines += [str(p) for p in self.problems]
        lines.append("verdict: " + ("ready to train" if self.ok else
                                    f"{sum(p.fatal for p in self.problems)} problem(s) would break a fit"))
        return "\n".join(lines)


class _Listener:
    """A TCP port on the driver's address that tasks try to reach (what the launch's channel
    needs), accepting and closing connections until closed."""

    def __init__(self, host: str):
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(0.5)
        self.address = self.sock.getsockname()[:2]
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._accept, name="sparkring-doctor", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
                conn.close()
            except OSError:
                continue

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(2)
        self.sock.close()


def _run_probes(spark, num_tasks: int, host: str, port: int, timeout: float,
                store: Optional[Tuple[str, Dict[str, Any]]] = None) -> List[_probe.TaskFacts]:
    """The barrier stage, with the probe pickled by value; cancelled after ``timeout`` s."""
    rows: Dict[str, Any] = {}
    tag = JobTag(spark, f"sparkring-doctor-{uuid.uuid4().hex[:8]}", f"sparkring doctor: {num_tasks} tasks")

    def stage():
        try:
            with tag:
                df = spark.range(0, num_tasks, 1, num_tasks).mapInArrow(
                    _probe.barrier_probe(host, port, store), "facts string", barrier=True)
                rows["facts"] = [r.facts for r in df.collect()]
        except Exception as exc:  # noqa: BLE001 - reported as the verdict
            rows["error"] = exc

    thread = probe_thread(stage, "sparkring-doctor-stage", timeout)
    if thread.is_alive():
        tag.cancel()
        thread.join(30)
        raise TimeoutError(f"the barrier stage of {num_tasks} task(s) did not finish within {timeout:g} s")
    if "error" in rows:
        raise rows["error"]
    return [_probe.TaskFacts.from_json(text) for text in rows["facts"]]


def doctor(spark=None, num_tasks: Optional[int] = None, timeout: float = 120.0,
           store: Union[None, str, Store] = None) -> DoctorReport:
    """Check the session's cluster before training: one barrier task per slot (or ``num_tasks``);
    with ``store``, that every task writes, reads back and removes a file in it.

    >>> report = sparkring.doctor(spark, store=Store("s3://bucket/runs", storage_options=opts))  # doctest: +SKIP
    >>> print(report)  # doctest: +SKIP
    >>> assert report.ok, report  # doctest: +SKIP
    """
    from pyspark.sql import SparkSession

    spark = spark or SparkSession.getActiveSession()
    if spark is None:
        raise ValueError("no active Spark session: pass doctor(spark)")
    facts = session_facts(spark)
    slots = facts.slots
    if not num_tasks and not facts.local and not facts.connect:
        slots = settled_slots(spark) or slots  # one task per executor slot: wait for them all to register
    wanted = num_tasks or slots or 1
    driver = package_versions()
    interpreter = executor_interpreter(spark, timeout)
    wrong = interpreter.problem() if interpreter is not None else None
    if wrong is not None:  # the barrier probe would fail on it, less clearly
        return DoctorReport(master=facts.master, driver_versions=driver, slots_wanted=wanted, executors=[],
                            problems=[Problem("executors", wrong.what, wrong.fix, True)],
                            gpus_per_task=facts.task_gpus)
    listener = _Listener(facts.driver_host)
    problems: List[Problem] = []
    try:
        checked = store if isinstance(store, Store) or store is None else Store(str(store))
        where = None if checked is None else (checked.url, checked.storage_options)
        found = _run_probes(spark, wanted, facts.driver_host, listener.address[1], timeout, where)
    except Exception as exc:  # noqa: BLE001 - the stage itself failing is the finding
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        problems.append(Problem("cluster", f"a barrier stage of {wanted} task(s) failed: {first}",
                                "give the session at least as many task slots as ranks (executors x "
                                "cores / spark.task.cpus), without dynamic allocation shrinking it", True))
        found = []
    finally:
        listener.close()
    executors: "OrderedDict[str, ExecutorReport]" = OrderedDict()
    for f in found:
        report = executors.get(f.executor)
        if report is None:
            executors[f.executor] = ExecutorReport(f.executor, f, 1, list(f.gpus_assigned))
        else:
            report.tasks += 1
            report.gpus_assigned += f.gpus_assigned
    for e in executors.values():
        problems += _verdicts(e, driver)
    return DoctorReport(master=facts.master, driver_versions=driver, slots_wanted=wanted,
                        executors=list(executors.values()), problems=problems, gpus_per_task=facts.task_gpus,
                        ranks_per_task=default_ranks_per_task(facts.task_gpus > 0, facts.task_gpus))


def _verdicts(e: ExecutorReport, driver: Dict[str, str]) -> List[Problem]:
    f, where = e.facts, f"executor {e.executor}"
    out: List[Problem] = []
    if f.versions.get("sparkring") == "missing":
        out.append(Problem(where, f"sparkring is not installed for {f.python_executable}", _SHIP_FIX, True))
    lines = skew(driver, {where: {k: v for k, v in f.versions.items()
                                  if not (k == "sparkring" and v == "missing")}})
    if lines:
        out.append(Problem(where, "other versions than the driver's: " + lines[0].split(": ", 1)[1], _SHIP_FIX,
                           True))
    for error in f.errors:
        out.append(Problem(where, error, "install a torch build that imports on this executor", True))
    if e.gpus_assigned and not f.gpus_visible:
        out.append(Problem(where, f"Spark assigned GPU(s) {e.gpus_assigned} but torch sees none",
                           "install a CUDA build of torch on the executors (or set useGpu=False)", True))
    elif e.gpus_assigned and not f.nccl:
        out.append(Problem(where, "GPUs without NCCL: the ranks fall back to gloo",
                           "install a torch build with NCCL", False))
    if f.shm_free_bytes is not None and f.shm_free_bytes < _SHM_PER_RANK * e.tasks:
        out.append(Problem(where, f"/dev/shm has {f.shm_free_bytes / 2**20:.0f} MiB free for {e.tasks} rank(s)",
                           "give containers a larger /dev/shm (docker --shm-size, a Memory emptyDir on "
                           "Kubernetes) or set sharedMemory=False", False))
    if f.store_error:
        out.append(Problem(where, f"cannot write to the Store ({f.store_error})",
                           "give every executor the Store's credentials and endpoint (storage_options, or the "
                           "usual environment variables in spark.executorEnv) and a route to it", True))
    if not f.driver_reachable:
        out.append(Problem(where, f"cannot reach the driver at {f.driver_error}",
                           "set spark.driver.host (or SPARK_LOCAL_IP on a Connect client) to an address the "
                           "executors reach and open the port range, or pass streamLogs=False", False))
    return out
