"""What a Spark session offers a barrier stage, read the same way on classic and Spark Connect
sessions (``spark.conf`` only; the scheduler is asked directly only where a SparkContext exists),
and how jobs of a run are tagged and cancelled on either kind of session."""
from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import List, Optional, Tuple

log = logging.getLogger(__name__)


def spark_major() -> int:
    """The installed pyspark's major version (3 or 4): where their APIs differ, one test of it."""
    import pyspark

    return int(pyspark.__version__.split(".")[0])


def is_connect(spark) -> bool:
    """True for a Spark Connect session (no SparkContext, no RDDs)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def _conf(spark, key: str, default: Optional[str] = None) -> Optional[str]:
    try:
        value = spark.conf.get(key, default)
    except Exception:  # noqa: BLE001 - a Connect server may refuse to read some keys
        return default
    return default if value is None else value


# Spark settings that say the cluster's traffic must be encrypted or authenticated. sparkring's
# rank-to-rank traffic (gloo, NCCL, MPI) is neither, so a run refuses to start under them unless the
# user opts in with ACCEPT_PLAIN_TRAFFIC (the name follows TorchDistributor's
# pytorch.spark.distributor.ignoreSsl).
SECURITY_SETTINGS = ("spark.ssl.enabled", "spark.network.crypto.enabled", "spark.authenticate")
ACCEPT_PLAIN_TRAFFIC = "spark.sparkring.ignoreSsl"


def _flag(spark, key: str) -> bool:
    return (_conf(spark, key, "false") or "false").strip().lower() == "true"


@dataclass(frozen=True)
class SessionFacts:
    """Everything the launch plan needs to know about the session, read once.

    >>> facts = session_facts(spark)  # doctest: +SKIP
    >>> facts.master, facts.slots  # doctest: +SKIP
    ('local[2]', 2)
    """

    master: str
    connect: bool
    task_cpus: int
    task_gpus: float
    executor_gpus: float
    driver_gpu_amount: float
    dynamic_allocation: bool
    max_failures: int
    max_stage_attempts: int
    slots: Optional[int]            # None where the session cannot tell (a Connect cluster)
    gpu_slots: Optional[int]
    driver_gpus: Tuple[str, ...]    # local mode, classic session: what the driver discovered
    driver_gpu_script: Optional[str]  # local mode, Connect: the tasks run it themselves
    driver_host: str                # where tasks reach the process that called run()
    secured_by: Tuple[str, ...]     # the security settings that are on (SECURITY_SETTINGS)
    plain_traffic_accepted: bool    # ACCEPT_PLAIN_TRAFFIC=true: the user accepts unencrypted rank traffic
    max_executors: Optional[int] = None   # spark.dynamicAllocation.maxExecutors (None: no bound)
    executor_cores: Optional[int] = None  # spark.executor.cores (None: as the cluster manager decides)

    @property
    def autoscaling(self) -> bool:
        """Dynamic allocation on a cluster: executors come and go with the pending tasks."""
        return self.dynamic_allocation and not self.local

    def autoscaling_bound(self) -> Tuple[Optional[int], str]:
        """The most concurrent tasks dynamic allocation can give (None: unknown) and the settings
        that bound it, for messages."""
        if self.max_executors is None:
            return None, "no spark.dynamicAllocation.maxExecutors"
        setting = f"spark.dynamicAllocation.maxExecutors={self.max_executors}"
        if self.executor_cores is None:
            return None, setting
        per_executor = self.executor_cores // self.task_cpus
        return self.max_executors * per_executor, (f"{setting}, spark.executor.cores={self.executor_cores}, "
                                                   f"spark.task.cpus={self.task_cpus}")

    @property
    def local(self) -> bool:
        """local[N] (tasks in the driver's JVM), not local-cluster."""
        return bool(re.fullmatch(r"local(\[.*\])?", self.master))

    @property
    def single_host(self) -> bool:
        """Every task runs on this machine (local or local-cluster)."""
        return self.local or self.master.startswith("local-cluster")

    @property
    def local_cluster(self) -> Optional[Tuple[int, int]]:
        """local-cluster[E, C, M]'s (executors E, cores C of each); None for any other master."""
        return local_cluster_shape(self.master)


def local_cluster_shape(master: str) -> Optional[Tuple[int, int]]:
    """(executors, cores per executor) of a ``local-cluster[E, C, M]`` master URL, else None.

    >>> local_cluster_shape("local-cluster[2, 1, 1024]")
    (2, 1)
    """
    m = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _local_cores(master: str) -> Optional[int]:
    m = re.fullmatch(r"local(?:\[(\*|\d+)(?:\s*,\s*\d+)?\])?", master)
    if not m:
        return None
    if m.group(1) is None:
        return 1
    return (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))


def _max_failures(spark, master: str) -> int:
    """How many times Spark may run a task: local[N,F] says F, local[N] means 1, clusters read
    spark.task.maxFailures (default 4)."""
    m = re.fullmatch(r"local\[(?:\*|\d+)\s*,\s*(\d+)\]", master)
    if m:
        return int(m.group(1))
    if re.fullmatch(r"local(\[.*\])?", master):
        return 1
    return int(_conf(spark, "spark.task.maxFailures", "4") or 4)


def _classic_driver_gpus(spark) -> Tuple[str, ...]:
    try:
        info = spark.sparkContext.resources.get("gpu")
    except Exception:  # noqa: BLE001 - older contexts have no resources
        info = None
    return tuple(info.addresses) if info is not None else ()


def registered_slots(spark) -> Optional[int]:
    """Concurrent task slots the scheduler of a classic session has now (executors that
    registered); None where Spark's internal API is not there (it can change between versions)."""
    sc = spark.sparkContext
    try:
        jsc = sc._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # noqa: BLE001
        return None


def executor_ids(spark) -> Optional[List[str]]:
    """Ids of the executors registered now (the driver not among them); None where Spark's
    internal API is not there (a Connect session)."""
    try:
        ids = spark.sparkContext._jsc.sc().getExecutorIds()
        return [ids.apply(i) for i in range(ids.size())]
    except Exception:  # noqa: BLE001
        return None


def decommissioning_executors(spark) -> Optional[List[str]]:
    """Ids of the executors the scheduler was told are decommissioning (spark.decommission.enabled:
    a standalone worker sent SIGPWR, a Kubernetes pod being deleted): they finish their tasks and
    get no new ones. None where Spark's internal API is not there."""
    try:
        jsc = spark.sparkContext._jsc.sc()
        scheduler, ids = jsc.taskScheduler(), jsc.getExecutorIds()
        return [e for e in (ids.apply(i) for i in range(ids.size()))
                if scheduler.getExecutorDecommissionState(e).isDefined()]
    except Exception:  # noqa: BLE001
        return None


def give_up_executors_on(spark, hosts: List[str]) -> List[str]:
    """Tell the scheduler that the executors on ``hosts`` (addresses, as the executors report
    them) are gone, so no task goes there while Spark's own heartbeat would still count them for
    minutes: each is killed through the cluster manager, which cannot reach it but stops
    offering its slots at once. The ids given up; none on a Connect session.

    >>> give_up_executors_on(spark, ["198.18.0.12"])  # doctest: +SKIP
    ['1']
    """
    try:
        jsc = spark.sparkContext._jsc.sc()
        summaries = jsc.statusStore().executorList(True)
        doomed = [e.id() for e in (summaries.apply(i) for i in range(summaries.size()))
                  if e.id() != "driver" and e.hostPort().rsplit(":", 1)[0] in hosts]
    except Exception:  # noqa: BLE001 - Spark's internal API (a Connect session has none)
        return []
    for executor in doomed:
        log.info("giving up executor %s: its host stopped answering", executor)
        jsc.killExecutor(executor)
    return doomed


def _scheduler_slots(spark) -> Optional[int]:
    """Slots of a classic cluster session: the scheduler's count once executors registered,
    else the default parallelism."""
    slots = registered_slots(spark)
    return slots if slots else int(spark.sparkContext.defaultParallelism)


def wait_for_slots(spark, wanted: int, timeout: float) -> bool:
    """On a classic cluster session, wait until the scheduler offers ``wanted`` concurrent
    slots (executors still registering after the session started); True once it does."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        slots = registered_slots(spark)
        if slots is None or slots >= wanted:  # None: no way to ask; the launch finds out
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def settled_slots(spark, quiet_s: float = 2.0, timeout: float = 30.0) -> Optional[int]:
    """A classic cluster session's concurrent task slots once executors stop registering: the
    count unchanged for ``quiet_s`` (at least one executor), or what there is after ``timeout``.
    A session just started (the CLI's) has its executors still arriving."""
    import time

    deadline = time.monotonic() + timeout
    last, since = registered_slots(spark), time.monotonic()
    while last is not None and time.monotonic() < deadline:
        time.sleep(0.25)
        now = registered_slots(spark)
        if now != last:
            last, since = now, time.monotonic()
        elif last and time.monotonic() - since >= quiet_s:
            break
    return last


def _conf_slots(spark, task_cpus: int) -> Optional[int]:
    """Slots of a cluster from its static configuration (Connect has no scheduler handle)."""
    instances, cores = _conf(spark, "spark.executor.instances"), _conf(spark, "spark.executor.cores")
    if instances and cores and instances.isdigit() and cores.isdigit():
        return int(instances) * (int(cores) // task_cpus)
    return None


def _driver_host(spark, connect: bool) -> str:
    """The address tasks use to reach this process: spark.driver.host on a classic session
    (the driver JVM lives in this process), SPARK_LOCAL_IP or this host's name on a Connect
    client."""
    host = None if connect else _conf(spark, "spark.driver.host")
    host = host or os.environ.get("SPARK_LOCAL_IP") or socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def session_facts(spark) -> SessionFacts:
    """Read the facts of ``spark`` (classic or Connect) without starting a job."""
    connect = is_connect(spark)
    master = _conf(spark, "spark.master", "") or ""
    task_cpus = int(_conf(spark, "spark.task.cpus", "1") or 1)
    task_gpus = float(_conf(spark, "spark.task.resource.gpu.amount", "0") or 0)
    executor_gpus = float(_conf(spark, "spark.executor.resource.gpu.amount", "0") or 0)
    driver_gpu_amount = float(_conf(spark, "spark.driver.resource.gpu.amount", "0") or 0)
    local = bool(re.fullmatch(r"local(\[.*\])?", master))
    driver_gpus = _classic_driver_gpus(spark) if local and not connect else ()
    script = _conf(spark, "spark.driver.resource.gpu.discoveryScript") if local and connect else None

    cores = _local_cores(master)
    cluster = local_cluster_shape(master)
    if cores is not None:
        local_slots = cores // task_cpus
        slots: Optional[int] = local_slots
        known_gpus = len(driver_gpus) if not connect else int(driver_gpu_amount)
        gpu_slots: Optional[int] = min(local_slots, int(known_gpus // (task_gpus or 1)))
    elif cluster:
        executors, per_exec = cluster
        slots = executors * (per_exec // task_cpus)
        gpu_slots = min(slots, executors * int(executor_gpus // task_gpus)) if task_gpus > 0 else 0
    else:
        slots = _conf_slots(spark, task_cpus) if connect else _scheduler_slots(spark)
        gpu_slots = slots
    return SessionFacts(
        master=master, connect=connect, task_cpus=task_cpus, task_gpus=task_gpus,
        executor_gpus=executor_gpus, driver_gpu_amount=driver_gpu_amount,
        dynamic_allocation=_flag(spark, "spark.dynamicAllocation.enabled"),
        max_failures=_max_failures(spark, master),
        max_stage_attempts=int(_conf(spark, "spark.stage.maxConsecutiveAttempts", "4") or 4),
        slots=slots, gpu_slots=gpu_slots, driver_gpus=driver_gpus, driver_gpu_script=script,
        driver_host=_driver_host(spark, connect),
        secured_by=tuple(key for key in SECURITY_SETTINGS if _flag(spark, key)),
        plain_traffic_accepted=_flag(spark, ACCEPT_PLAIN_TRAFFIC),
        max_executors=_optional_int(_conf(spark, "spark.dynamicAllocation.maxExecutors")),
        executor_cores=_optional_int(_conf(spark, "spark.executor.cores")))


def _optional_int(text: Optional[str]) -> Optional[int]:
    return int(text) if text and text.strip().isdigit() else None


def request_executors(spark, total: int) -> bool:
    """Ask the cluster manager for ``total`` executors now (a classic session under dynamic
    allocation: before the ranks' tasks are pending, to learn what the cluster gives); False
    where the session offers no way to ask (Connect, an older Spark)."""
    try:
        sc = spark.sparkContext
        nothing_local = sc._jvm.PythonUtils.toScalaMap(sc._jvm.java.util.HashMap())
        return bool(sc._jsc.sc().requestTotalExecutors(int(total), 0, nothing_local))
    except Exception as exc:  # noqa: BLE001 - the pending tasks ask for executors anyway
        log.debug("could not request %d executors: %s", total, exc)
        return False


class JobTag:
    """Tags the Spark jobs started by the calling thread so that another thread can cancel
    them: session tags on Spark Connect (thread-local in its client), a job group that
    interrupts its tasks on classic sessions.

    >>> tag = JobTag(spark, "sparkring-1234")  # doctest: +SKIP
    >>> with tag: df.collect()  # doctest: +SKIP
    >>> tag.cancel()  # doctest: +SKIP
    """

    def __init__(self, spark, name: str, description: str = ""):
        self.spark = spark
        self.name = name
        self.description = description
        self.tags = is_connect(spark)

    def __enter__(self) -> "JobTag":
        if self.tags:
            self.spark.addTag(self.name)
        else:
            self.spark.sparkContext.setJobGroup(self.name, self.description, interruptOnCancel=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.tags:
            try:
                self.spark.removeTag(self.name)
            except Exception:  # noqa: BLE001 - a stopped session has nothing left to untag
                pass

    def cancel(self) -> None:
        """Cancel the Spark jobs of this tag (quietly where Spark cannot)."""
        try:
            if self.tags:
                self.spark.interruptTag(self.name)
            else:
                self.spark.sparkContext.cancelJobGroup(self.name)
        except Exception as exc:  # noqa: BLE001 - the job may be over already
            log.debug("cancelling jobs tagged %s: %s", self.name, exc)


_timer_release_registered = False


def release_barrier_timer_at_exit(spark) -> None:
    """Spark 3.5 keeps a non-daemon ``java.util.Timer`` for barrier() calls in every JVM that
    ran a barrier task (SPARK-46895 made it a daemon in 4.0). In local mode that JVM is the
    driver's, so ``spark-submit train.py`` never exits after the script ends. When this Python
    process exits, cancel that timer (no barrier task can follow then) so the JVM can stop."""
    global _timer_release_registered
    if _timer_release_registered or spark_major() >= 4 or is_connect(spark):
        return
    _timer_release_registered = True
    import atexit

    jvm = spark.sparkContext._jvm
    atexit.register(_cancel_barrier_timer, jvm)


def _cancel_barrier_timer(jvm) -> None:
    try:
        holder = jvm.java.lang.Class.forName("org.apache.spark.BarrierTaskContext$")
        module = holder.getField("MODULE$").get(None)
        for field in holder.getDeclaredFields():  # Scala names it org$apache$spark$...$$timer
            if field.getType().getName() == "java.util.Timer":
                field.setAccessible(True)
                field.get(module).cancel()
                log.debug("cancelled Spark 3.5's barrier() timer so that the driver JVM can exit")
    except Exception as exc:  # noqa: BLE001 - the gateway may be gone already: nothing to release
        log.debug("could not cancel Spark's barrier() timer: %s", exc)
