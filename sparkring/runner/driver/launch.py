"""``run()`` and ``launch()``: execute a function (or script) once per rank in one Spark barrier stage,
``spark.range(n, numPartitions=n).mapInArrow(task, schema, barrier=True)``, the same on classic
and Spark Connect sessions; the driver follows the ranks over the live channel where the tasks
can reach it and reads everything else from the stage's output records."""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ...collective import elastic, environment, timeline
from ...collective.elastic import Relaunches
from ...errors import ConfigurationError, HostLostError, RankTimeoutError
from .. import pickling
from ..channel import DriverChannel
from ..protocol import Abort, TaskSpec
from ..versions import package_versions
from .elastic import ElasticLaunch, ElasticPolicy, relaunch_until_done
from .horovod_launch import parse_hosts, ranks_from_hosts, translate_run_keywords
from .interpreter import check_executor_interpreter
from .ledger import OWN_STREAMS, RankOutput, RunLedger
from .outcome import raise_for_outcome
from .plan import DEFAULT_HEARTBEAT_TIMEOUT, RUN_NAMES, LaunchPlan, LaunchRequest, ParamNames, check_timeouts, plan_for
from .script import ScriptMain
from .session import JobTag, give_up_executors_on, release_barrier_timer_at_exit, session_facts, wait_for_slots
from .stage import Stage
from .watch import Watch

log = logging.getLogger(__name__)


def active_spark():
    """The caller's session: the active one (classic or Connect), else a new one from the
    builder (which honours SPARK_REMOTE); one sparkring starts in local mode runs its executors
    on this interpreter unless PYSPARK_PYTHON says otherwise."""
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None:
        if not os.environ.get("SPARK_REMOTE") and "--master" not in os.environ.get("PYSPARK_SUBMIT_ARGS", ""):
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # local[*]: this machine, this Python
        spark = SparkSession.builder.getOrCreate()
    return spark


def run(fn: Union[Callable[..., Any], str], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
        num_proc: Optional[int] = None, backend: str = "auto", use_gpu: Optional[bool] = None,
        start_timeout: float = 120, timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
        verbose: int = 1, on_event: Optional[Callable[[int, Any], None]] = None, stream: bool = True,
        spark=None, shared_memory: bool = True, min_proc: Optional[int] = None, max_restarts: int = 3,
        elastic_dir: Optional[str] = None, ranks_per_task: Optional[int] = None, resource_profile: Any = "auto",
        heartbeat_timeout: Optional[float] = DEFAULT_HEARTBEAT_TIMEOUT, output: RankOutput = OWN_STREAMS,
        **horovod_names: Any) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` once per rank in a Spark barrier stage; return the
    results ordered by rank. Works on classic and Spark Connect sessions.

    ``fn`` may also be a Python script's path, run as ``__main__`` with ``args`` as its command
    line (each rank then returns 0). ``stream=False`` (or executors that cannot reach this
    process) turns live output off: logs, events and errors arrive when the stage ends.
    ``shared_memory=False`` sends CPU allreduces within a host through gloo, not /dev/shm.
    Tensors travel as CPU tensors: move them to the rank's device inside ``fn``.

    ``min_proc`` makes the run elastic (``sparkring.collective.elastic`` inside ``fn``): when ranks
    are lost it launches again, at most ``max_restarts`` times, with the slots the cluster offers
    within ``start_timeout`` (at least ``min_proc``), and with ``num_proc`` when they come back,
    resuming from the last ``state.commit()`` rank 0 persists under ``elastic_dir`` (a directory
    every executor reaches; a temporary one where every task runs here).

    ``ranks_per_task`` ranks run in each Spark task (by default one per GPU of a task that holds
    several); ``num_proc`` counts ranks. ``resource_profile``: "auto" asks for ``ranks_per_task``
    GPUs per task through a stage-level ResourceProfile where spark.task.resource.gpu.amount is
    less (Spark 4 on standalone, YARN or Kubernetes), "off" never does, or pass a ResourceProfile.

    ``heartbeat_timeout``: a host silent that long (its tasks beat from their own processes, so a
    busy rank still beats) ends the run with ``HostLostError``; an elastic run goes on without it.
    ``output`` says where the ranks' printed lines go (streams of your own, a time on each line).

    Horovod's ``horovod.run()`` keywords are accepted too, so its examples' ``--num-proc`` paths run
    as written: ``np`` (num_proc), ``min_np`` (min_proc), ``max_np`` (the elastic target, num_proc;
    ``np`` then is min_proc unless ``min_np`` says), ``use_gloo``/``use_mpi`` (backend), ``verbose``
    and ``hosts`` ("localhost:4": that many ranks; several hosts need a cluster on them).

    >>> import sparkring.collective as sr
    >>> def fn():
    ...     return sr.allreduce(torch.tensor([sr.rank()], dtype=torch.float32)).item()
    >>> run(fn, num_proc=2)  # doctest: +SKIP
    [0.5, 0.5]
    """
    check_timeouts(timeout, start_timeout, RUN_NAMES, heartbeat_timeout)
    fn, args, kwargs = _runnable(fn, args, kwargs)
    spark = spark or active_spark()
    if horovod_names:
        num_proc, min_proc, backend, verbose = _with_horovod_names(spark, horovod_names, num_proc=num_proc,
                                                                   min_proc=min_proc, backend=backend, verbose=verbose)
    launch_plan = plan_for(spark, LaunchRequest(num_proc=num_proc, use_gpu=use_gpu, backend=backend, stream=stream,
                                                names=RUN_NAMES, shared_memory=shared_memory,
                                                registration_wait=start_timeout, ranks_per_task=ranks_per_task,
                                                resource_profile=resource_profile, min_proc=min_proc))
    env = _with_trace(env)
    if min_proc is None:
        return launch(spark, launch_plan, fn, args, kwargs, start_timeout=start_timeout, timeout=timeout, env=env,
                      verbose=verbose, on_event=on_event, heartbeat_timeout=heartbeat_timeout, output=output)
    return launch_elastic(spark, launch_plan, fn, args, kwargs, min_proc=min_proc, max_restarts=max_restarts,
                          elastic_dir=elastic_dir, start_timeout=start_timeout, timeout=timeout, env=env,
                          verbose=verbose, on_event=on_event, heartbeat_timeout=heartbeat_timeout, output=output)


def _runnable(fn: Union[Callable[..., Any], str], args: Sequence[Any],
              kwargs: Optional[Dict[str, Any]]) -> Tuple[Callable[..., Any], Sequence[Any], Optional[Dict[str, Any]]]:
    """``fn`` as a callable: a script's path runs as ``__main__`` with ``args`` as its command line."""
    if isinstance(fn, (str, os.PathLike)):
        return ScriptMain(str(fn), list(args)), (), None
    if not callable(fn):
        raise ConfigurationError(f"fn must be a callable or a script path, got {type(fn).__name__}")
    return fn, args, kwargs


def _with_horovod_names(spark, horovod_names: Dict[str, Any], *, num_proc: Optional[int], min_proc: Optional[int],
                        backend: str, verbose: int) -> Tuple[Optional[int], Optional[int], str, int]:
    """run()'s (num_proc, min_proc, backend, verbose) after horovod.run()'s keywords (``hosts`` counts ranks)."""
    ours = translate_run_keywords(horovod_names, dict(num_proc=num_proc, min_proc=min_proc, backend=backend,
                                                      verbose=verbose))
    num_proc, min_proc, backend, verbose = ours["num_proc"], ours["min_proc"], ours["backend"], ours["verbose"]
    if horovod_names.get("hosts"):
        facts = session_facts(spark)
        num_proc = ranks_from_hosts(parse_hosts(horovod_names["hosts"]), num_proc, facts.single_host, facts.slots)
    return num_proc, min_proc, backend, verbose


def _with_trace(env: Optional[Dict[str, str]]) -> Optional[Dict[str, str]]:
    """The ranks' environment, asking every rank for its spans where a timeline is requested
    (launch() merges them into that file on the driver)."""
    given = env or {}
    trace = given.get(environment.TIMELINE) or given.get(environment.HOROVOD_TIMELINE) or timeline.requested()
    return {**given, environment.TIMELINE: trace} if trace else env


def check_elastic(launch_plan: LaunchPlan, min_proc: int, max_restarts: int, elastic_dir: Optional[str],
                  names: ParamNames = RUN_NAMES) -> None:
    """An elastic run's settings, refused before any Spark job.

    >>> check_elastic(plan(spark, num_proc=3), min_proc=4, max_restarts=3, elastic_dir=None)  # doctest: +SKIP
    Traceback (most recent call last):
    ConfigurationError: min_proc=4 is larger than num_proc=3 ...
    """
    if not 1 <= min_proc <= launch_plan.num_proc:
        raise ConfigurationError(f"{names.min_proc}={min_proc}: it must be between 1 and {names.num_proc}="
                                 f"{launch_plan.num_proc} (the ranks the run trains with when the cluster has them)")
    if min_proc % launch_plan.ranks_per_task:
        raise ConfigurationError(f"{names.min_proc}={min_proc} is not a multiple of {names.ranks_per_task}="
                                 f"{launch_plan.ranks_per_task}: a lost task takes all its ranks with it")
    if max_restarts < 0:
        raise ConfigurationError(f"max_restarts={max_restarts}: it must be 0 or more")
    if elastic_dir is None and not launch_plan.facts.single_host:
        raise ConfigurationError(
            f"an elastic run on {launch_plan.facts.master} needs {names.elastic_dir}=<a directory every executor "
            "reads and writes> (a shared mount, hdfs://, s3://): rank 0 persists each commit there and the next "
            "launch, on any executor, resumes from it")


def launch_elastic(spark, launch_plan: LaunchPlan, fn: Callable[..., Any], args: Sequence[Any] = (),
                   kwargs: Optional[Dict[str, Any]] = None, *, min_proc: int, max_restarts: int = 3,
                   elastic_dir: Optional[str] = None, start_timeout: float = 120, timeout: Optional[float] = None,
                   env: Optional[Dict[str, str]] = None, verbose: int = 1,
                   on_event: Optional[Callable[[int, Any], None]] = None, names: ParamNames = RUN_NAMES,
                   heartbeat_timeout: Optional[float] = DEFAULT_HEARTBEAT_TIMEOUT,
                   output: RankOutput = OWN_STREAMS) -> List[Any]:
    """Launch as :func:`launch` does, again (from the last commit) when ranks are lost or the
    slots come back: run()'s elastic mode (``min_proc``) and the CLI's ``--min-np``.

    >>> launch_elastic(spark, plan(spark, num_proc=3), train, min_proc=2)  # doctest: +SKIP
    """
    check_elastic(launch_plan, min_proc, max_restarts, elastic_dir, names)
    temporary = elastic_dir is None
    directory = tempfile.mkdtemp(prefix="sparkring-elastic-") if temporary else str(elastic_dir)
    rank_env = {**(env or {}), environment.ELASTIC_DIR: directory}

    how = ElasticLaunch(launch_plan.num_proc, min_proc, max_restarts, start_timeout,
                        start_timeout_name=names.start_timeout, min_size_name=names.min_proc,
                        ranks_per_task=launch_plan.ranks_per_task)
    policy = _RunPolicy(how, lambda now: launch(spark, now, fn, args, kwargs, start_timeout=start_timeout,
                                                timeout=timeout, env=rank_env, verbose=verbose, on_event=on_event,
                                                heartbeat_timeout=heartbeat_timeout, names=names, output=output),
                        lambda size: dataclasses.replace(plan_for(spark, LaunchRequest(
                            num_proc=size, use_gpu=launch_plan.use_gpu,
                            backend="auto" if launch_plan.backend_from_auto else launch_plan.backend,
                            stream=launch_plan.stream, names=names, shared_memory=launch_plan.shared_memory,
                            ranks_per_task=launch_plan.ranks_per_task,
                            resource_profile=launch_plan.profile if launch_plan.profile is not None else "off")),
                            attempts=1), verbose)
    try:
        return relaunch_until_done(spark, dataclasses.replace(launch_plan, attempts=1), policy,
                                   elastic.stop_request_in(directory))
    finally:
        if temporary:
            shutil.rmtree(directory, ignore_errors=True)


class _RunPolicy(ElasticPolicy):
    """run()'s elastic mode: ranks that stopped when asked return elastic.Paused; each launch
    resumes from the last commit."""

    def __init__(self, how: ElasticLaunch, launch_once: Callable[[LaunchPlan], List[Any]],
                 replan: Callable[[int], LaunchPlan], verbose: int):
        super().__init__(how)
        self._launch_once, self._replan, self.verbose = launch_once, replan, verbose

    def launch(self, launch_plan: LaunchPlan, counts: Relaunches) -> List[Any]:
        return self._launch_once(launch_plan)

    def replan(self, size: int) -> LaunchPlan:
        return self._replan(size)

    def is_paused(self, results: List[Any]) -> bool:
        return any(isinstance(r, elastic.Paused) for r in results)

    def resume_point(self) -> str:
        return "the last commit"

    def say(self, message: str) -> None:
        super().say(message)
        if self.verbose:
            print(f"sparkring: {message}", file=sys.stderr, flush=True)


class _TimelineCollector:
    """A launch's timeline, run()'s and fit()'s alike: the rank environment's SPARKRING_TIMELINE
    names the file; each rank sends its spans as its last event, the driver merges them there."""

    def __init__(self, path: str, forward: Optional[Callable[[int, Any], None]]):
        self.path, self.forward = path, forward
        self.by_rank: Dict[int, List[Any]] = {}

    def on_event(self, rank: int, payload: Any) -> None:
        if isinstance(payload, dict) and timeline.EVENTS_KEY in payload:
            self.by_rank[rank] = payload[timeline.EVENTS_KEY]
        elif self.forward is not None:
            self.forward(rank, payload)

    def write(self) -> None:
        timeline.merge([self.by_rank[r] for r in sorted(self.by_rank)], self.path)


def launch(spark, launch_plan: LaunchPlan, fn: Callable[..., Any], args: Sequence[Any] = (),
           kwargs: Optional[Dict[str, Any]] = None, start_timeout: float = 120, timeout: Optional[float] = None,
           env: Optional[Dict[str, str]] = None, verbose: int = 1,
           on_event: Optional[Callable[[int, Any], None]] = None,
           heartbeat_timeout: Optional[float] = DEFAULT_HEARTBEAT_TIMEOUT, names: ParamNames = RUN_NAMES,
           output: RankOutput = OWN_STREAMS) -> List[Any]:
    """Launch ``fn`` on the ranks of a plan made by :func:`plan` (what ``run()`` does after
    planning; the estimator plans before its data jobs and launches here). ``names`` spells the
    caller's settings in its messages.

    >>> results = launch(spark, plan(spark, num_proc=2), fn)  # doctest: +SKIP
    """
    num_proc = launch_plan.num_proc
    facts = launch_plan.facts
    check_executor_interpreter(spark, start_timeout)  # once per application: a missing sparkring in one line
    shm_env = {} if launch_plan.shared_memory else {environment.SHM: "0"}
    if facts.local and not facts.connect:  # the barrier tasks run in this driver's JVM
        release_barrier_timer_at_exit(spark)
    payload = _payload(fn, args, kwargs)
    if (not facts.connect and not facts.local and launch_plan.profile is None and not launch_plan.gang
            and not wait_for_slots(spark, launch_plan.num_tasks, start_timeout)):
        raise RankTimeoutError(f"the cluster did not offer {launch_plan.num_tasks} concurrent task slots within "
                               f"start_timeout={start_timeout:g}s: add executors/cores or lower the "
                               "number of ranks", list(range(num_proc)))
    trace_path = (env or {}).get(environment.TIMELINE)
    trace = _TimelineCollector(trace_path, on_event) if trace_path else None
    secret = os.urandom(32)
    state = RunLedger(num_proc, verbose, trace.on_event if trace is not None else on_event, output)
    channel = DriverChannel(launch_plan.driver_host, secret, state.handle)
    state.channel = channel
    spec = TaskSpec(payload=payload, driver_host=launch_plan.driver_host, driver_port=channel.address[1],
                    secret=secret, num_proc=num_proc, backend=launch_plan.backend, use_gpu=launch_plan.use_gpu,
                    driver_gpus=list(launch_plan.driver_gpus), driver_gpu_script=launch_plan.driver_gpu_script,
                    start_timeout=float(start_timeout), timeout=timeout, attempts=launch_plan.attempts,
                    stream=launch_plan.stream, env={**(env or {}), **shm_env}, task_cpus=launch_plan.task_cpus,
                    backend_from_auto=launch_plan.backend_from_auto, driver_versions=package_versions(),
                    ranks_per_task=launch_plan.ranks_per_task, gang=launch_plan.gang,
                    heartbeat_timeout=heartbeat_timeout)
    tag = JobTag(spark, f"sparkring-{uuid.uuid4().hex[:12]}", f"sparkring.run: {num_proc} ranks")
    stage = Stage(spark, spec, launch_plan, tag, start_timeout)
    log.info("launching %d ranks (a payload of %d bytes; driver channel %s:%d)", num_proc, len(payload),
             *channel.address)
    stage.start()
    try:
        _watch(stage, channel, Watch(state, launch_plan, start_timeout, timeout, stage.started,
                                     heartbeat_timeout=heartbeat_timeout, names=names))
        raise_for_outcome(state, stage.outcome, num_proc, start_timeout, timeout)
    except KeyboardInterrupt:
        # Ctrl-C: classic PySpark's own SIGINT handler cancels every job of the context, a
        # Connect client cancels nothing; stop exactly this run's ranks and job either way
        log.info("interrupted: stopping the ranks and cancelling the Spark job of this run")
        channel.broadcast(Abort(reason="the driver was interrupted (KeyboardInterrupt)"))
        stage.cancel()
        raise
    finally:
        channel.close()
        _last_worker_pids[:] = state.pids
    if trace is not None:
        trace.write()
    return stage.outcome.results(num_proc)


def _payload(fn: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]]) -> bytes:
    """What every rank runs, pickled; what cannot be pickled is named (``args[1]``, ``kwargs['model']``)."""
    named: Dict[str, Any] = {"fn": fn}
    named.update({f"args[{i}]": arg for i, arg in enumerate(args)})
    named.update({f"kwargs[{key!r}]": value for key, value in (kwargs or {}).items()})
    return pickling.dumps((fn, tuple(args), kwargs or {}), named)


def _watch(stage: Stage, channel: DriverChannel, watch: Watch) -> None:
    """Until the stage ends: a failure the watch sees (a rank's error, a timeout) stops every rank and the job."""
    while stage.running():
        failure = watch.failure()
        if failure is not None:
            channel.broadcast(Abort(reason=str(failure)))
            stage.cancel()
            if isinstance(failure, HostLostError):  # no later launch may wait for its slots
                give_up_executors_on(stage.spark, sorted({where.rsplit(":", 1)[0] for where in failure.lost.values()
                                                          if where}))
            raise failure


_last_worker_pids: List[int] = []


def last_worker_pids() -> List[int]:
    """Process ids of the rank workers of the latest run() (all gone once it returns)."""
    return list(_last_worker_pids)
