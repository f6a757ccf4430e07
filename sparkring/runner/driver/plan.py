"""The launch plan: how many ranks, GPUs or not, which backend, how many stage attempts, where
the driver channel listens; decided and validated once, before any Spark job, for run(), the
CLI and the estimator alike."""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ...collective.hosting import TRANSPORTS, transport
from ...errors import ConfigurationError
from ..gpus import backend_on_shared_gpus
from .resources import StageResources, profile_task_amounts, stage_resources
from .session import ACCEPT_PLAIN_TRAFFIC, SessionFacts, registered_slots, session_facts, wait_for_slots

log = logging.getLogger(__name__)

BACKENDS = ("auto",) + tuple(TRANSPORTS)


@dataclass(frozen=True)
class ParamNames:
    """How the caller spells the parameters, so messages name the user's own argument."""

    num_proc: str = "num_proc"
    use_gpu: str = "use_gpu"
    backend: str = "backend"
    timeout: str = "timeout"
    start_timeout: str = "start_timeout"
    min_proc: str = "min_proc"
    elastic_dir: str = "elastic_dir"
    ranks_per_task: str = "ranks_per_task"
    resource_profile: str = "resource_profile"
    heartbeat_timeout: str = "heartbeat_timeout"


RUN_NAMES = ParamNames()
ESTIMATOR_NAMES = ParamNames(num_proc="numProc", use_gpu="useGpu", backend="backend", min_proc="minProc",
                             ranks_per_task="ranksPerTask", resource_profile="resourceProfile",
                             heartbeat_timeout="heartbeatTimeout")
DISTRIBUTOR_NAMES = ParamNames(num_proc="num_processes", use_gpu="use_gpu", backend="backend")
CLI_NAMES = ParamNames(num_proc="-np", use_gpu="--use-gpu", backend="--backend", timeout="--timeout",
                       start_timeout="--start-timeout", min_proc="--min-np", elastic_dir="--elastic-dir",
                       ranks_per_task="--ranks-per-task", heartbeat_timeout="--heartbeat-timeout")
# Seconds a running rank's task may go without a word to the driver before its host counts as lost.
DEFAULT_HEARTBEAT_TIMEOUT = 30.0


def check_timeouts(timeout: Optional[float], start_timeout: Optional[float], names: ParamNames,
                   heartbeat_timeout: Optional[float] = None) -> None:
    """The limits are seconds > 0 (``timeout=None``: no limit on the ranks' run time;
    ``heartbeat_timeout=None``: a silent host is left to Spark's own heartbeat).

    >>> check_timeouts(None, 120, RUN_NAMES, heartbeat_timeout=0)
    Traceback (most recent call last):
    sparkring.errors.ConfigurationError: heartbeat_timeout=0: it must be a positive number of seconds or None (no limit)
    """
    for name, value in ((names.timeout, timeout), (names.start_timeout, start_timeout),
                        (names.heartbeat_timeout, heartbeat_timeout)):
        if value is not None and not value > 0:
            raise ConfigurationError(f"{name}={value:g}: it must be a positive number of seconds"
                                     + (" or None (no limit)" if name != names.start_timeout else ""))


@dataclass(frozen=True)
class LaunchPlan:
    """One barrier stage, decided once: ``run()``, the CLI and the estimator launch from it.

    >>> p = plan(spark, num_proc=2)  # doctest: +SKIP
    >>> p.num_proc, p.backend, p.attempts  # doctest: +SKIP
    (2, 'gloo', 1)
    """

    num_proc: int
    use_gpu: bool
    backend: str
    attempts: int                   # times Spark may run the stage (a shuffle after it when > 1)
    stream: bool                    # try the live channel to the driver
    driver_host: str
    driver_gpus: Tuple[str, ...]
    driver_gpu_script: Optional[str]
    task_cpus: int
    facts: SessionFacts
    shared_memory: bool = True      # CPU allreduce between ranks of one host through /dev/shm
    backend_from_auto: bool = False  # backend="auto" chose it: the tasks may still fall back to gloo
    ranks_per_task: int = 1         # ranks each task runs (one per GPU of a task holding several)
    profile: Any = None             # the training stage's pyspark ResourceProfile (None: the application's)
    gang: bool = False              # dynamic allocation: an ordinary stage whose tasks meet at the driver
    limits: str = ""                # the settings that bound an autoscaling cluster, for messages

    @property
    def num_tasks(self) -> int:
        """Tasks of the barrier stage."""
        return self.num_proc // self.ranks_per_task


def _check_mpi_installed() -> None:
    from .._probe import find_mpiexec, mpi_library

    missing = [name for name, ok in (("mpi4py", importlib.util.find_spec("mpi4py") is not None),
                                     ("mpiexec", find_mpiexec() is not None)) if not ok]
    if missing:
        raise ConfigurationError(
            f"backend='mpi' needs {' and '.join(missing)} on the driver and every executor: "
            "pip install 'sparkring[mpi]' (mpi4py and the mpich wheel), or use backend='gloo'")
    library = mpi_library()
    if library is not None and "Open MPI" in library:
        # Each rank starts under its own mpiexec and joins the others by MPI_Comm_connect, which
        # Open MPI allows only beside an ompi-server; its mpiexec also fails a rank that ends
        # without MPI_Finalize (seen on a GPU machine whose image has Open MPI).
        raise ConfigurationError(
            f"backend='mpi' runs on MPICH, but mpi4py here runs on {library.split(',')[0]}: install "
            "'sparkring[mpi]' in an environment without Open MPI's mpi4py (mpi4py with the mpich wheel), "
            "or use backend='gloo'")


def _check_local_task_gpus(facts: SessionFacts) -> None:
    """Local mode offers its tasks no resources: a task that asks for a GPU is never scheduled
    (every job of the session waits: seen with Spark 3.5 and 4.3, on an H200 and with fake discovery), so
    the ranks would never start."""
    if facts.local and facts.task_gpus > 0:
        raise ConfigurationError(
            f"spark.task.resource.gpu.amount={facts.task_gpus:g} in local mode: Spark never schedules a task that "
            "asks for GPUs there, so the ranks could not start. Remove it (and spark.executor.resource.gpu.amount); "
            "sparkring hands the driver's GPUs (spark.driver.resource.gpu.amount and "
            "spark.driver.resource.gpu.discoveryScript) to the ranks by local rank")


def _check_gpus(facts: SessionFacts, names: ParamNames) -> None:
    if facts.local:
        if not (facts.driver_gpus or (facts.connect and facts.driver_gpu_amount > 0)):
            raise ConfigurationError(
                f"{names.use_gpu}=True in local mode but the driver has no GPUs: set "
                "spark.driver.resource.gpu.amount and spark.driver.resource.gpu.discoveryScript")
    elif facts.task_gpus <= 0:
        raise ConfigurationError(
            f"{names.use_gpu}=True but spark.task.resource.gpu.amount is not set: set it (usually 1) "
            "with spark.executor.resource.gpu.amount so Spark schedules one GPU per task")


def nccl_available() -> bool:
    """This process's torch has NCCL (the executors are expected to run the same build)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def _ranks_share_gpus(facts: SessionFacts, num_proc: int, task_gpus: float) -> bool:
    """Spark would give two ranks of one host the same GPU: a fractional
    spark.task.resource.gpu.amount, or local mode with fewer driver GPUs than ranks."""
    if facts.local:
        known = len(facts.driver_gpus) if not facts.connect else int(facts.driver_gpu_amount)
        return num_proc > known
    return 0 < task_gpus < 1


def _decide_backend(backend: str, use_gpu: bool, shared_gpus: bool, names: ParamNames) -> str:
    """The one transport every rank uses, decided here rather than by each rank from what it sees
    (ranks that disagree hang in init)."""
    where, why = "ranks on one host would", " (a fractional spark.task.resource.gpu.amount, or fewer GPUs than ranks "
    why += "in local mode)"
    if backend == "nccl" and shared_gpus:
        return backend_on_shared_gpus("nccl", from_auto=False, where=where, name=names.backend, why=why)
    if backend != "auto":
        return backend
    if not use_gpu:
        return "gloo"
    if not nccl_available():
        log.warning("GPUs are scheduled but this torch has no NCCL: the ranks use gloo")
        return "gloo"
    if shared_gpus:
        return backend_on_shared_gpus("nccl", from_auto=True, where=where, name=names.backend, why=why)
    return "nccl"


def local_backend(num_proc: int, use_gpu: bool) -> str:
    """The backend of ranks started on the driver's host without Spark (TorchDistributor's
    ``local_mode``): a GPU of this host each when ``use_gpu``, so NCCL where torch has it.

    >>> local_backend(2, use_gpu=False)
    'gloo'
    """
    if use_gpu:
        import torch

        if torch.cuda.device_count() < num_proc:
            raise ConfigurationError(
                f"use_gpu=True with local_mode=True needs {num_proc} GPU(s) on this host, which has "
                f"{torch.cuda.device_count()}: pass use_gpu=False, or fewer num_processes")
    return _decide_backend("auto", use_gpu, shared_gpus=False, names=DISTRIBUTOR_NAMES)


def _check_security(facts: SessionFacts) -> None:
    if not facts.secured_by:
        return
    settings = " and ".join(f"{key}=true" for key in facts.secured_by)
    if not facts.plain_traffic_accepted:
        raise ConfigurationError(
            f"{settings}: this cluster secures Spark's own traffic, but sparkring's rank-to-rank traffic "
            "(gloo, NCCL or MPI tensors) is neither encrypted nor authenticated, and its driver channel is "
            f"signed (HMAC-SHA256) but not encrypted. Set {ACCEPT_PLAIN_TRAFFIC}=true (spark-submit --conf, "
            "or spark.conf.set) if the network between executors is trusted and you accept that")
    log.warning("%s, but %s=true: rank traffic is not encrypted (accepted by the user)", settings,
                ACCEPT_PLAIN_TRAFFIC)


def _slots_once_registered(spark, facts: SessionFacts, wanted: int, slots: int, wait: float) -> int:
    """The slots of a classic cluster session once ``wanted`` are there or ``wait`` seconds have
    passed (executors register one by one after the application starts); ``slots`` elsewhere."""
    if facts.connect or facts.master.startswith("local"):
        return slots  # local modes know their slots from the master URL
    wait_for_slots(spark, wanted, wait)
    return registered_slots(spark) or slots


def _task_slots(facts: SessionFacts, use_gpu: bool, resources: StageResources) -> Optional[int]:
    """Concurrent tasks of the training stage: the application's slots, or under a profile what a
    local-cluster's executors hold (None elsewhere: Spark refuses a barrier stage it cannot place)."""
    if resources.profile is None:
        return facts.gpu_slots if use_gpu else facts.slots
    if facts.local_cluster is None:
        return None
    executors, cores = facts.local_cluster
    cpus = profile_task_amounts(resources.profile)[0] or facts.task_cpus
    per_executor = cores // cpus
    if resources.task_gpus > 0:
        per_executor = min(per_executor, int(facts.executor_gpus // resources.task_gpus))
    return executors * per_executor


def _check_slots(spark, facts: SessionFacts, use_gpu: bool, resources: StageResources, num_proc: Optional[int],
                 registration_wait: float, names: ParamNames) -> int:
    """The number of ranks, checked against the tasks the session can run at once."""
    k = resources.ranks_per_task
    slots = _task_slots(facts, use_gpu, resources)
    if num_proc is None:
        if slots is None:
            raise ConfigurationError(
                f"this session does not say how many task slots it has (master {facts.master!r}, no "
                f"spark.executor.instances/spark.executor.cores): pass {names.num_proc}=<number of ranks>")
        return slots * k
    tasks = num_proc // k
    if slots is not None and tasks > slots and registration_wait > 0 and resources.profile is None:
        slots = _slots_once_registered(spark, facts, tasks, slots, registration_wait)
    if slots is not None and tasks > slots:
        what = "GPU task slots" if use_gpu else "task slots"
        per_task = f" ({k} ranks per task: {tasks} tasks)" if k > 1 else ""
        raise ConfigurationError(
            f"{names.num_proc}={num_proc}{per_task} is larger than the {slots} concurrent {what} of this session "
            f"(master {facts.master}, spark.task.cpus={facts.task_cpus}); a barrier stage needs all its "
            f"tasks running at once: lower {names.num_proc} to at most {slots * k} or add executors/cores")
    if slots is None:
        log.info("session %s does not report its slots; Spark itself refuses a barrier stage larger than "
                 "the cluster", facts.master)
    return num_proc


def _check_autoscaling(facts: SessionFacts, ranks_per_task: int, num_proc: Optional[int],
                       min_proc: Optional[int], names: ParamNames) -> int:
    """The number of ranks under dynamic allocation: refused where the bound on executors cannot
    ever run them (or ``min_proc`` of them) at once."""
    bound, why = facts.autoscaling_bound()
    if num_proc is None:
        if bound is None:
            raise ConfigurationError(f"under dynamic allocation the session has no fixed number of task slots "
                                     f"({why}): pass {names.num_proc}=<number of ranks>")
        return bound * ranks_per_task
    needed = -(-(min_proc or num_proc) // ranks_per_task)
    if bound is not None and needed > bound:
        raise ConfigurationError(
            f"{names.num_proc}={num_proc} needs {needed} tasks at once, more than dynamic allocation can give "
            f"({why}: {bound} tasks): raise spark.dynamicAllocation.maxExecutors or lower {names.num_proc}")
    return num_proc


@dataclass(frozen=True)
class LaunchRequest:
    """What a caller asks of a launch (Ray Train's ScalingConfig): ``plan`` decides the LaunchPlan
    from it and the session. ``registration_wait``: seconds a cluster whose executors are still
    registering has to offer the slots; ``min_proc``: an elastic caller's least size, which an
    autoscaling bound must allow.

    >>> LaunchRequest(num_proc=2, backend="gloo").backend
    'gloo'
    """

    num_proc: Optional[int] = None
    use_gpu: Optional[bool] = None
    backend: str = "auto"
    stream: bool = True
    names: ParamNames = RUN_NAMES
    shared_memory: bool = True
    registration_wait: float = 0.0
    ranks_per_task: Optional[int] = None
    resource_profile: Any = "auto"
    min_proc: Optional[int] = None


def plan(spark, num_proc: Optional[int] = None, **request: Any) -> LaunchPlan:
    """Decide and check the launch of ``num_proc`` ranks on ``spark``: ``plan_for`` of the
    LaunchRequest the keywords make (its fields).

    >>> p = plan(spark, num_proc=2, backend="gloo")  # doctest: +SKIP
    """
    return plan_for(spark, LaunchRequest(num_proc=num_proc, **request))


def plan_for(spark, request: LaunchRequest) -> LaunchPlan:
    """Decide and check the launch ``request`` asks for on ``spark`` (classic or Connect);
    raises ConfigurationError naming the caller's parameter before any Spark job. On a cluster
    whose executors are still registering (an application that just started), waits up to
    ``registration_wait`` seconds for the slots before refusing. ``ranks_per_task`` ranks run in
    each task (by default one per GPU of a task holding several); the training stage asks for its
    own task resources through ``resource_profile`` ("auto": where ranks per task need more GPUs
    than spark.task.resource.gpu.amount; "off"; or a ResourceProfile). Under dynamic allocation
    the ranks run as an ordinary stage whose tasks meet at the driver (``gang``).

    >>> p = plan_for(spark, LaunchRequest(num_proc=2, backend="gloo"))  # doctest: +SKIP
    """
    names, backend = request.names, request.backend
    _check_request(request)
    facts = session_facts(spark)
    _check_local_task_gpus(facts)
    use_gpu = facts.task_gpus > 0 if request.use_gpu is None else bool(request.use_gpu)
    _check_against_session(request, facts, use_gpu)
    resources = stage_resources(facts, use_gpu, request.num_proc, request.ranks_per_task, request.resource_profile,
                                names)
    if use_gpu and resources.task_gpus > resources.ranks_per_task:
        log.info("%g GPUs per task for %d rank(s): each rank sees its share, the first one is current; "
                 "sparkring's collectives and the estimator use that one", resources.task_gpus,
                 resources.ranks_per_task)
    if facts.autoscaling:
        num_proc = _check_autoscaling(facts, resources.ranks_per_task, request.num_proc, request.min_proc, names)
    else:
        num_proc = _check_slots(spark, facts, use_gpu, resources, request.num_proc, request.registration_wait, names)
    _check_security(facts)
    # an ordinary stage is never rerun as a whole: a lost task is a lost rank (elastic, or the run fails).
    # Spark reruns a failed barrier map stage with a fresh task set each time, up to
    # maxConsecutiveAttempts, so a task's failures never add up to spark.task.maxFailures (local[N,F]);
    # maxFailures=1 is read as "no retries" (the stage is then a result stage, never rerun).
    attempts = 1 if facts.autoscaling or facts.max_failures <= 1 else max(1, facts.max_stage_attempts)
    shared = use_gpu and _ranks_share_gpus(facts, num_proc, resources.task_gpus / resources.ranks_per_task)
    chosen = _decide_backend(backend, use_gpu, shared, names)
    result = LaunchPlan(num_proc=num_proc, use_gpu=use_gpu, backend=chosen, attempts=attempts,
                        stream=bool(request.stream), driver_host=facts.driver_host, driver_gpus=facts.driver_gpus,
                        driver_gpu_script=facts.driver_gpu_script, task_cpus=facts.task_cpus, facts=facts,
                        shared_memory=bool(request.shared_memory), backend_from_auto=backend == "auto",
                        ranks_per_task=resources.ranks_per_task, profile=resources.profile,
                        gang=facts.autoscaling, limits=facts.autoscaling_bound()[1] if facts.autoscaling else "")
    log.info("launch plan: %d ranks (%d per task), backend %s, gpu %s, %d stage attempt(s), driver %s, %s session %s",
             result.num_proc, result.ranks_per_task, chosen, result.use_gpu, attempts, result.driver_host,
             "Connect" if facts.connect else "classic", facts.master)
    return result


def _check_request(request: LaunchRequest) -> None:
    """What the request alone gets wrong (an unknown backend, MPI not installed, too few ranks)."""
    names, backend = request.names, request.backend
    if backend not in BACKENDS:
        raise ConfigurationError(f"{names.backend}={backend!r} is not known; use one of {', '.join(BACKENDS)}")
    if backend != "auto" and transport(backend).starts_under_mpiexec:
        _check_mpi_installed()
    if request.num_proc is not None and request.num_proc < 1:
        raise ConfigurationError(f"{names.num_proc}={request.num_proc}: it must be at least 1")


def _check_against_session(request: LaunchRequest, facts: SessionFacts, use_gpu: bool) -> None:
    """What the session cannot run of the request (NCCL without GPUs, a detached gang, GPUs it lacks)."""
    names, backend = request.names, request.backend
    if backend != "auto" and transport(backend).needs_gpus and not use_gpu:
        raise ConfigurationError(f"{names.backend}='nccl' needs GPUs: pass {names.use_gpu}=True (and schedule "
                                 "GPUs with spark.task.resource.gpu.amount), or use backend='gloo'")
    if facts.autoscaling and not request.stream:
        raise ConfigurationError(
            "spark.dynamicAllocation.enabled=true: the ranks then run as an ordinary stage (Spark has no barrier "
            "stage under dynamic allocation) and meet only at the driver; keep the live channel on (drop "
            "stream=False / streamLogs=False)")
    if use_gpu:
        _check_gpus(facts, names)
