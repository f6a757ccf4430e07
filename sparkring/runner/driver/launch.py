"""``run()``: execute a function (or script) once per rank in one Spark barrier stage,
``spark.range(n, numPartitions=n).mapInArrow(task, schema, barrier=True)``, the same on classic
and Spark Connect sessions; the driver follows the ranks over the live channel where the tasks
can reach it and reads everything else from the stage's output records."""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import runpy
import shutil
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import cloudpickle

from ...collective import elastic, environment, timeline
from ...errors import ConfigurationError, RankFailedError, RankTimeoutError, SparkRingError, StageLostError
from .. import pickling, protocol
from ..channel import DriverChannel
from ..protocol import (
    Abort,
    Arrived,
    ConnectionClosed,
    Detached,
    Done,
    Error,
    Event,
    Frame,
    Gathered,
    Hello,
    Join,
    Log,
    Stacks,
    Started,
)
from ..task.barrier import RECORD_SCHEMA, TaskSpec, stage_function
from ..versions import package_versions
from .elastic import ElasticLaunch, Relaunches, relaunch_until_done
from .plan import RUN_NAMES, LaunchPlan, ParamNames, check_timeouts, plan
from .session import JobTag, release_barrier_timer_at_exit, wait_for_slots

log = logging.getLogger(__name__)
# How a cancelled job reads: Spark 4's error class, Spark 3.5's "Job 12 cancelled part of ..."
_CANCELLED = re.compile(r"SPARK_JOB_CANCELLED|Job \d+ cancelled")
_SLOTS_CHECK = "BarrierJobSlotsNumberCheckFailed"
# How long the driver waits, from a stage's first join, for every rank to join before the tasks
# gather through Spark's allGather instead (a task that cannot reach the driver gives up after
# TaskSpec.connect_timeout).
JOIN_WINDOW_S = 10.0
# How long a stage with one planned attempt may go on after a rank failed or went away before the
# driver ends it (the stage normally ends by itself at once, with the rank's own error).
LOST_GRACE_S = 3.0
SAME_LOSS_S = 0.25  # tasks that go away this close together went with one loss (an executor, a host)


class ScriptExit(SystemExit):
    """A script run on a rank exited with a non-zero status."""

    def __init__(self, code):
        super().__init__(code)
        self.exit_code = code if isinstance(code, int) else 1


class ScriptMain:
    """Runs a Python file as ``__main__`` with ``sys.argv``, the way ``python file.py`` would.

    >>> run(ScriptMain("train.py", ["--epochs", "2"]), num_proc=2)  # doctest: +SKIP
    """

    def __init__(self, path: str, argv: Sequence[str] = ()):
        self.path = os.path.abspath(path)
        self.argv = [str(a) for a in argv]
        try:
            with open(self.path) as f:  # fail on the driver, not on every rank
                f.read(1)
        except OSError as exc:
            raise ConfigurationError(f"script {path!r} cannot be read ({exc.strerror}): pass the path of a "
                                     "Python file that exists on the driver") from exc

    def __call__(self) -> int:
        sys.argv = [self.path] + self.argv
        sys.path.insert(0, os.path.dirname(self.path))
        try:
            runpy.run_path(self.path, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
                raise ScriptExit(exc.code) from None
        return 0


class _RunState:
    """What the driver learns over the channel while the barrier stage runs."""

    def __init__(self, num_proc: int, verbose: int, on_event, out=None, err=None):
        self.num_proc = num_proc
        self.verbose = verbose
        self.on_event = on_event
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.lock = threading.Lock()
        self.attempt = 0
        self.attempt_started = time.monotonic()
        self.hello: Dict[int, set] = {}
        self.executors: Dict[int, Dict[int, str]] = {}  # attempt -> rank -> its executor's host:port
        # attempt -> rank -> when its task's connection closed before it was done
        self.gone: Dict[int, Dict[int, float]] = {}
        self.arrived: set = set()
        self.timeouts: Dict[int, Dict[int, str]] = {}
        self.stacks: Dict[int, Dict[int, str]] = {}
        self.done: Dict[int, set] = {}
        self.errors: Dict[int, Error] = {}
        self.failed_at: Dict[int, float] = {}  # attempt -> when a rank of it failed or went away
        self.pids: List[int] = []
        self.channel: Optional[DriverChannel] = None
        self.detached = False
        self.joins: Dict[int, Dict[int, Tuple[Join, Any]]] = {}  # stage -> rank -> (join, its connection)
        self.join_started: Dict[int, float] = {}

    def handle(self, msg: Frame, conn=None) -> None:
        """One frame from a rank: live from the channel (``conn``), or replayed from the
        stage's output records after it ended (``conn`` None)."""
        if isinstance(msg, Arrived):
            with self.lock:
                self.arrived.add(msg.rank)
        elif isinstance(msg, Detached):
            self.detached = True
        elif isinstance(msg, Hello):
            self._hello(msg, conn)
        elif isinstance(msg, ConnectionClosed):
            if conn is not None:
                self.forget_joins_of(conn)
            if conn is not None and conn.info.get("task"):
                rank, attempt = int(conn.info["rank"]), int(conn.info["attempt"])
                with self.lock:
                    if rank not in self.done.get(attempt, set()):
                        self.failed_at.setdefault(attempt, time.monotonic())
                        self.gone.setdefault(attempt, {}).setdefault(rank, time.monotonic())
        elif isinstance(msg, Started):
            with self.lock:
                self.pids.append(msg.pid)
        elif isinstance(msg, Log):
            self._print(msg.rank, msg.stream, msg.line)
        elif isinstance(msg, Event):
            if self.on_event is not None:
                try:
                    self.on_event(msg.rank, msg.payload)
                except Exception as exc:  # noqa: BLE001 - a progress bug must not kill training
                    print(f"sparkring: on_event callback failed: {exc!r}", file=self.err)
        elif isinstance(msg, Stacks):
            with self.lock:
                self.stacks.setdefault(msg.attempt, {})[msg.rank] = msg.stacks
        elif isinstance(msg, Done):
            with self.lock:
                self.done.setdefault(msg.attempt, set()).add(msg.rank)
        elif isinstance(msg, Error):
            self._error(msg, conn)
        elif isinstance(msg, Join) and conn is not None:
            self._join(msg, conn)

    def _join(self, msg: Join, conn) -> None:
        """Gather the tasks' rendezvous records here; once every rank of the stage joined, each
        gets all of them. A newer join of a rank replaces an older one (a retried stage)."""
        with self.lock:
            group = self.joins.setdefault(msg.stage, {})
            self.join_started.setdefault(msg.stage, time.monotonic())
            group[msg.rank] = (msg, conn)
            if len(group) < self.num_proc:
                return
            del self.joins[msg.stage]
            self.join_started.pop(msg.stage, None)
        records = [group[rank][0].record for rank in range(self.num_proc)]
        for _, member in group.values():
            member.send(Gathered(records=records))

    def forget_joins_of(self, conn) -> None:
        """A task's connection closed: its join is stale (its stage attempt failed)."""
        with self.lock:
            for group in self.joins.values():
                for rank in [r for r, (_, c) in group.items() if c is conn]:
                    del group[rank]

    def expire_joins(self, window: float) -> None:
        """Joins that waited ``window`` seconds without every rank: some task cannot reach the
        driver, so all of them gather through Spark's allGather (decided here once per stage)."""
        now = time.monotonic()
        with self.lock:
            late = [stage for stage, since in self.join_started.items() if now - since > window]
            groups = [self.joins.pop(stage) for stage in late]
            for stage in late:
                del self.join_started[stage]
        for group in groups:
            log.info("not every task reached the driver: the ranks meet through Spark's allGather")
            for _, member in group.values():
                member.send(Gathered(records=None))

    def _hello(self, msg: Hello, conn) -> None:
        if conn is not None:
            conn.info.update(rank=msg.rank, attempt=msg.attempt, task=True)
        with self.lock:
            if msg.attempt > self.attempt or not self.hello:
                if msg.attempt > self.attempt:
                    self.attempt_started = time.monotonic()
                self.attempt = max(self.attempt, msg.attempt)
            self.hello.setdefault(msg.attempt, set()).add(msg.rank)
            if msg.executor:
                self.executors.setdefault(msg.attempt, {})[msg.rank] = msg.executor

    def lost_ranks(self) -> Dict[int, str]:
        """The latest attempt's ranks whose tasks went away first, with their executors'
        addresses ("" unknown). Spark then kills the stage's other tasks, whose connections close
        later: only those gone within ``SAME_LOSS_S`` of the first count as lost."""
        with self.lock:
            if not self.gone:
                return {}
            attempt = max(self.gone)
            when = self.gone[attempt]
            first = min(when.values())
            where = self.executors.get(attempt, {})
            return {rank: where.get(rank, "") for rank in sorted(when) if when[rank] - first <= SAME_LOSS_S}

    def executor_of(self, rank: int, attempt: int) -> Optional[str]:
        with self.lock:
            return self.executors.get(attempt, {}).get(rank) or None

    def _error(self, msg: Error, conn) -> None:
        rank, attempt = msg.rank, msg.attempt
        with self.lock:
            if msg.kind == protocol.TIMEOUT:
                self.timeouts.setdefault(attempt, {})[rank] = msg.traceback
            first = attempt not in self.errors
            self.failed_at.setdefault(attempt, time.monotonic())
            if first or (self.errors[attempt].secondary and not msg.secondary):
                self.errors[attempt] = msg  # a rank that only lost its peer yields to the cause
        if first and self.channel is not None and conn is not None:
            timed_out = msg.kind == protocol.TIMEOUT
            reason = f"rank {rank} exceeded its timeout" if timed_out else f"rank {rank} failed"
            self.channel.broadcast(Abort(reason=reason, dump=timed_out),
                                   where=lambda c: bool(c.info.get("task")) and c.info.get("attempt") == attempt
                                   and c.info.get("rank") != rank)

    def _print(self, rank: int, stream: Optional[str], line: str) -> None:
        if self.verbose <= 0 or (self.verbose == 1 and rank != 0):
            return
        target = self.err if stream == "stderr" else self.out
        text = f"[{rank}] {line}" if self.verbose >= 2 else line
        with self.lock:
            print(text, file=target, flush=True)

    def first_error(self) -> Optional[Error]:
        """The latest attempt's error: a timeout where a rank ran out of time (the others'
        errors then only say that it was killed), else the first error."""
        with self.lock:
            if not self.errors:
                return None
            attempt = max(self.errors)
            timed_out = self.timeouts.get(attempt)
            if timed_out:
                rank = min(timed_out)
                return Error(rank=rank, attempt=attempt, kind=protocol.TIMEOUT, traceback=timed_out[rank])
            return self.errors[attempt]


def active_spark():
    """The caller's session: the active one (classic or Connect), else a new one from the
    builder (which honours SPARK_REMOTE)."""
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None:
        spark = SparkSession.builder.getOrCreate()
    return spark


def run(fn: Union[Callable[..., Any], str], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
        num_proc: Optional[int] = None, backend: str = "auto", use_gpu: Optional[bool] = None,
        start_timeout: float = 120, timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
        verbose: int = 1, on_event: Optional[Callable[[int, Any], None]] = None, stream: bool = True,
        spark=None, shared_memory: bool = True, min_proc: Optional[int] = None, max_restarts: int = 3,
        elastic_dir: Optional[str] = None) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` once per rank in a Spark barrier stage; return the
    results ordered by rank. Works on classic and Spark Connect sessions.

    ``fn`` may also be the path of a Python script, run as ``__main__`` with ``args`` as
    its command line (the Horovod ``horovodrun`` habit); each rank then returns 0.
    ``stream=False`` (or executors that cannot reach this process) turns live output off:
    logs, events and errors then arrive when the stage ends. ``shared_memory=False`` sends
    CPU allreduces between ranks of one host through gloo instead of /dev/shm. Tensors in
    ``fn``, ``args`` and ``kwargs`` travel as CPU tensors (a model on the driver's GPU too):
    move them to the rank's device inside ``fn``.

    ``min_proc`` makes the run elastic (Horovod's elastic API inside ``fn``, see
    ``sparkring.collective.elastic``): when ranks are lost it launches again, at most
    ``max_restarts`` times, with the slots the cluster offers within ``start_timeout`` (at least
    ``min_proc``), and with ``num_proc`` again when the slots come back; each launch resumes from
    the last ``state.commit()``, which rank 0 persists under ``elastic_dir`` (a directory every
    executor reaches; a temporary one on this machine by default, where every task runs here).
    The results are those of the last launch's ranks.

    >>> import sparkring.collective as sr
    >>> def fn():
    ...     return sr.allreduce(torch.tensor([sr.rank()], dtype=torch.float32)).item()
    >>> run(fn, num_proc=2)  # doctest: +SKIP
    [0.5, 0.5]
    """
    check_timeouts(timeout, start_timeout, RUN_NAMES)
    if isinstance(fn, (str, os.PathLike)):
        fn, args, kwargs = ScriptMain(str(fn), list(args)), (), None
    elif not callable(fn):
        raise ConfigurationError(f"fn must be a callable or a script path, got {type(fn).__name__}")
    spark = spark or active_spark()
    launch_plan = plan(spark, num_proc=num_proc, use_gpu=use_gpu, backend=backend, stream=stream,
                       names=RUN_NAMES, shared_memory=shared_memory, registration_wait=start_timeout)
    given = env or {}
    trace = _TimelineCollector.requested(given.get(environment.TIMELINE) or given.get(environment.HOROVOD_TIMELINE),
                                         on_event)
    if trace is not None:
        env, on_event = {**(env or {}), environment.TIMELINE: trace.path}, trace.on_event
    if min_proc is None:
        results = launch(spark, launch_plan, fn, args, kwargs, start_timeout=start_timeout, timeout=timeout,
                         env=env, verbose=verbose, on_event=on_event)
    else:
        results = launch_elastic(spark, launch_plan, fn, args, kwargs, min_proc=min_proc,
                                 max_restarts=max_restarts, elastic_dir=elastic_dir, start_timeout=start_timeout,
                                 timeout=timeout, env=env, verbose=verbose, on_event=on_event)
    if trace is not None:
        trace.write()
    return results


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
                   on_event: Optional[Callable[[int, Any], None]] = None, names: ParamNames = RUN_NAMES) -> List[Any]:
    """Launch as :func:`launch` does, again (from the last commit) when ranks are lost or the
    slots come back: run()'s elastic mode (``min_proc``) and the CLI's ``--min-np``.

    >>> launch_elastic(spark, plan(spark, num_proc=3), train, min_proc=2)  # doctest: +SKIP
    """
    check_elastic(launch_plan, min_proc, max_restarts, elastic_dir, names)
    temporary = elastic_dir is None
    directory = tempfile.mkdtemp(prefix="sparkring-elastic-") if temporary else str(elastic_dir)
    rank_env = {**(env or {}), environment.ELASTIC_DIR: directory}

    def once(now: LaunchPlan, counts: Relaunches) -> List[Any]:
        return launch(spark, now, fn, args, kwargs, start_timeout=start_timeout, timeout=timeout, env=rank_env,
                      verbose=verbose, on_event=on_event)

    def replan(size: int) -> LaunchPlan:
        return dataclasses.replace(plan(spark, num_proc=size, use_gpu=launch_plan.use_gpu,
                                        backend="auto" if launch_plan.backend_from_auto else launch_plan.backend,
                                        stream=launch_plan.stream, names=names,
                                        shared_memory=launch_plan.shared_memory), attempts=1)

    def say(message: str) -> None:
        log.info("%s", message)
        if verbose:
            print(f"sparkring: {message}", file=sys.stderr, flush=True)

    how = ElasticLaunch(launch_plan.num_proc, min_proc, max_restarts, start_timeout,
                        start_timeout_name=names.start_timeout, min_size_name=names.min_proc)
    try:
        return relaunch_until_done(spark, dataclasses.replace(launch_plan, attempts=1), how, once, replan, say,
                                   request=elastic.stop_request_in(directory),
                                   paused=lambda results: any(isinstance(r, elastic.Paused) for r in results),
                                   resume_point=lambda: "the last commit")
    finally:
        if temporary:
            shutil.rmtree(directory, ignore_errors=True)


class _TimelineCollector:
    """run()'s timeline: SPARKRING_TIMELINE (or Horovod's HOROVOD_TIMELINE) names the file; each
    rank sends its spans as its last event, the driver merges them there."""

    def __init__(self, path: str, forward: Optional[Callable[[int, Any], None]]):
        self.path, self.forward = path, forward
        self.by_rank: Dict[int, List[Any]] = {}

    @classmethod
    def requested(cls, given: Optional[str], forward) -> Optional["_TimelineCollector"]:
        path = given or timeline.requested()
        return cls(path, forward) if path else None

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
           on_event: Optional[Callable[[int, Any], None]] = None) -> List[Any]:
    """Launch ``fn`` on the ranks of a plan made by :func:`plan` (what ``run()`` does after
    planning; the estimator plans before its data jobs and launches here).

    >>> results = launch(spark, plan(spark, num_proc=2), fn)  # doctest: +SKIP
    """
    num_proc = launch_plan.num_proc
    facts = launch_plan.facts
    shm_env = {} if launch_plan.shared_memory else {environment.SHM: "0"}
    if facts.local and not facts.connect:  # the barrier tasks run in this driver's JVM
        release_barrier_timer_at_exit(spark)
    named: Dict[str, Any] = {"fn": fn}
    named.update({f"args[{i}]": arg for i, arg in enumerate(args)})
    named.update({f"kwargs[{key!r}]": value for key, value in (kwargs or {}).items()})
    payload = pickling.dumps((fn, tuple(args), kwargs or {}), named)
    if not facts.connect and not facts.local and not wait_for_slots(spark, num_proc, start_timeout):
        raise RankTimeoutError(f"the cluster did not offer {num_proc} concurrent task slots within "
                               f"start_timeout={start_timeout:g}s: add executors/cores or lower the "
                               "number of ranks", list(range(num_proc)))
    secret = os.urandom(32)
    state = _RunState(num_proc, verbose, on_event)
    channel = DriverChannel(launch_plan.driver_host, secret, state.handle)
    state.channel = channel
    spec = TaskSpec(payload=payload, driver_host=launch_plan.driver_host, driver_port=channel.address[1],
                    secret=secret, num_proc=num_proc, backend=launch_plan.backend, use_gpu=launch_plan.use_gpu,
                    driver_gpus=list(launch_plan.driver_gpus), driver_gpu_script=launch_plan.driver_gpu_script,
                    start_timeout=float(start_timeout), timeout=timeout, attempts=launch_plan.attempts,
                    stream=launch_plan.stream, env={**(env or {}), **shm_env}, task_cpus=launch_plan.task_cpus,
                    backend_from_auto=launch_plan.backend_from_auto, driver_versions=package_versions())
    tag = JobTag(spark, f"sparkring-{uuid.uuid4().hex[:12]}", f"sparkring.run: {num_proc} ranks")
    stage = _Stage(spark, spec, launch_plan, tag, start_timeout)
    log.info("launching %d ranks (driver channel %s:%d)", num_proc, *channel.address)
    stage.start()
    try:
        watch = _Watch(state, launch_plan, start_timeout, timeout, stage.started)
        while stage.running():
            failure = watch.failure()
            if failure is not None:
                channel.broadcast(Abort(reason=str(failure)))
                stage.cancel()
                raise failure
        rows = stage.outcome.get("rows") or []
        _raise_for_outcome(state, stage.outcome, rows, num_proc, start_timeout, timeout)
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
    return _assemble([r for r in rows if r["kind"] == "result"], num_proc)


class _Stage:
    """The barrier stage, collected on a thread of its own; the launch is retried while Spark
    refuses it for lack of slots (executors still registering) within start_timeout."""

    def __init__(self, spark, spec: TaskSpec, launch_plan: LaunchPlan, tag: JobTag, start_timeout: float):
        self.spark, self.spec, self.plan, self.tag, self.start_timeout = spark, spec, launch_plan, tag, start_timeout
        self.outcome: Dict[str, Any] = {}
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._collect, name="sparkring-collect", daemon=True)

    def _frame(self):
        num_proc = self.plan.num_proc
        df = self.spark.range(0, num_proc, 1, num_proc).mapInArrow(stage_function(self.spec), RECORD_SCHEMA,
                                                                    barrier=True)
        if self.plan.attempts > 1:
            # Spark never retries a failed barrier *result* stage, only a barrier map stage: a
            # shuffle after the ranks lets it rerun them.
            df = df.repartition(1)
        return df

    def _collect(self) -> None:
        while True:
            try:
                with self.tag:
                    self.outcome["rows"] = self._frame().collect()
                return
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                # Spark refuses a barrier stage larger than the slots it has *now*; with adaptive
                # execution (a map stage submitted alone) it does not wait for executors that are
                # still registering, so the launch is retried until start_timeout.
                if _SLOTS_CHECK in str(exc) and time.monotonic() - self.started < self.start_timeout:
                    log.info("barrier stage refused for lack of slots; retrying while executors register")
                    time.sleep(1.0)
                    continue
                self.outcome["error"] = exc
                return

    def start(self) -> None:
        self.started = time.monotonic()
        self.thread.start()

    def running(self) -> bool:
        self.thread.join(0.1)
        return self.thread.is_alive()

    def cancel(self) -> None:
        self.tag.cancel()
        self.thread.join(30)


class _Watch:
    """What the driver decides while the stage runs: ranks that do not start, a run past its
    timeout, a failed attempt Spark does not restart, every attempt failed."""

    def __init__(self, state: _RunState, launch_plan: LaunchPlan, start_timeout: float, timeout: Optional[float],
                 started: float):
        self.state, self.plan, self.start_timeout, self.timeout = state, launch_plan, start_timeout, timeout
        self.started = started
        self.warned = False
        # Without a live channel expected from the start (a Connect client may be out of the
        # executors' reach), a missing hello is no sign of missing slots: the tasks' own
        # rendezvous timeout then decides.
        self.watches_start = launch_plan.stream and not launch_plan.facts.connect

    def failure(self) -> Optional[BaseException]:
        state, num_proc, now = self.state, self.plan.num_proc, time.monotonic()
        state.expire_joins(JOIN_WINDOW_S)
        with state.lock:
            attempt = state.attempt
            greeted = state.hello.get(attempt, set())
            since = state.attempt_started if state.hello else self.started
            arrived = set(state.arrived)
            failed_attempts = len(state.errors)
            failed_at = state.failed_at.get(attempt)
        late = len(greeted) < num_proc and now - since > self.start_timeout
        failure: Optional[BaseException] = None
        if late and self.watches_start and not state.detached:
            missing = sorted(set(range(num_proc)) - (arrived if len(arrived) < num_proc else greeted))
            failure = RankTimeoutError(
                f"ranks {missing} did not start within start_timeout={self.start_timeout:g}s; the "
                "cluster may lack free slots (other jobs running?) or executors are still starting", missing)
        elif late and not arrived and not self.warned:
            self.warned = True
            log.warning("no rank has reached this process (%s) within %gs: the cluster may lack free "
                        "slots, or the executors cannot reach it (the run then reports at its end)",
                        self.plan.driver_host, self.start_timeout)
        if self.timeout is not None and now - since > self.start_timeout + self.timeout + 30:
            running = sorted(set(range(num_proc)) - state.done.get(attempt, set()))
            failure = RankTimeoutError(f"ranks {running} exceeded timeout={self.timeout:g}s", running)
        if (failure is None and failed_at is not None and self.plan.attempts > 1 and self.watches_start
                and not state.detached and now - failed_at > self.start_timeout):
            failure = _not_restarted(state, attempt, num_proc, self.start_timeout)
        if (failure is None and failed_at is not None and self.plan.attempts == 1 and self.watches_start
                and not state.detached and now - failed_at > LOST_GRACE_S):
            failure = _no_attempt_left(state, attempt)
        if failure is None and self.plan.attempts > 1 and failed_attempts >= self.plan.attempts:
            err = state.first_error()
            assert err is not None  # every attempt failed
            failure = (_timeout_error(state, num_proc, self.timeout) if err.kind == protocol.TIMEOUT
                       else _rank_failed(err, state))
        return failure


def _raise_for_outcome(state: _RunState, outcome: Dict[str, Any], rows: List[Any], num_proc: int,
                       start_timeout: float, timeout: Optional[float]) -> None:
    """The stage ended: replay the frames its records carry, and raise what went wrong, if anything."""
    if "error" in outcome:
        log.debug("the barrier stage failed: %s", outcome["error"])
    else:  # the stage ended: what failed in attempts Spark retried is history
        with state.lock:
            state.errors.clear()
            state.timeouts.clear()
    for row in sorted((r for r in rows if r["kind"] == "message"), key=lambda r: r["rank"]):
        state.handle(protocol.loads(bytes(row["data"])))
    err = state.first_error()
    if err is None and "error" in outcome:
        err = protocol.found_error(str(outcome["error"]))
    if err is not None:
        if err.kind == protocol.TIMEOUT:
            state.timeouts.setdefault(err.attempt, {})[err.rank] = err.traceback
            raise _timeout_error(state, num_proc, timeout, wait=not rows) from None
        raise _rank_failed(err, state) from None
    if "error" not in outcome:
        return
    error = outcome["error"]
    if _SLOTS_CHECK in str(error):
        raise RankTimeoutError(f"the cluster did not offer {num_proc} concurrent task slots within "
                               f"start_timeout={start_timeout:g}s: add executors/cores or lower the "
                               "number of ranks", list(range(num_proc))) from None
    if _CANCELLED.search(str(error)):
        raise SparkRingError("the Spark job of this run was cancelled (cancelAllJobs, a job group or tag "
                             "cancel, or the Spark UI); its ranks were stopped") from error
    raise _stage_lost(state, f"the barrier stage failed before any rank reported an error: {error}") from error


def _not_restarted(state: _RunState, attempt: int, num_proc: int, start_timeout: float) -> RankTimeoutError:
    """An attempt of the stage failed and Spark has not started the next one: its slots are gone."""
    err = state.errors.get(attempt)
    if err is not None:
        lines = [line for line in err.traceback.strip().splitlines() if line.strip()]
        cause = f"rank {err.rank}: {lines[-1].strip() if lines else 'failed'}"
    else:
        cause = "a rank's task went away without a word (its executor was lost)"
    return RankTimeoutError(
        f"attempt {attempt + 1} of the barrier stage failed ({cause}) and Spark did not start the {num_proc} "
        f"ranks again within start_timeout={start_timeout:g}s: the cluster lacks {num_proc} free task slots "
        "(an executor was lost and did not come back, or other jobs hold the slots); add executors or lower "
        "the number of ranks", list(range(num_proc)))


def _no_attempt_left(state: _RunState, attempt: int) -> BaseException:
    """A rank of the only planned attempt failed or went away and the stage has not ended (Spark
    may be waiting to rerun the barrier tasks on slots that are gone): the run ends here."""
    err = state.errors.get(attempt)
    if err is not None:
        return _rank_failed(err, state)
    return _stage_lost(state, "a rank's task went away without a word (its executor was lost) and no other "
                              "attempt of the barrier stage is planned")


def _rank_failed(err: Error, state: _RunState) -> RankFailedError:
    return RankFailedError(err.rank, err.traceback, err.exit_code, executor=state.executor_of(err.rank, err.attempt))


def _stage_lost(state: _RunState, what: str) -> StageLostError:
    """The stage ended, or cannot go on, because tasks went away: the message names their ranks
    and executors where the driver saw them go."""
    lost = state.lost_ranks()
    gone = ", ".join(f"rank {rank}" + (f" (executor {where})" if where else "") for rank, where in lost.items())
    return StageLostError(f"{what}" + (f"; tasks that went away: {gone}" if gone else ""), lost=lost)


def _timeout_error(state: _RunState, num_proc: int, timeout: Optional[float], wait: bool = True) -> RankTimeoutError:
    """Name the ranks that ran out of time, with where every rank's threads were."""
    attempt = max(state.timeouts)
    deadline = time.monotonic() + (3 if wait else 0)  # live: the other ranks' stack dumps are on their way
    while time.monotonic() < deadline:
        with state.lock:
            have = set(state.timeouts.get(attempt, {})) | set(state.stacks.get(attempt, {}))
        if len(have) >= num_proc:
            break
        time.sleep(0.05)
    with state.lock:
        timed = dict(state.timeouts.get(attempt, {}))
        stacks = dict(state.stacks.get(attempt, {}))
    ranks = sorted(timed)
    parts = [timed[r] for r in ranks]
    parts += [f"rank {r} was stopped with them; where its threads were:\n{stacks[r]}"
              for r in sorted(stacks) if r not in timed]
    limit = f"timeout={timeout:g}s" if timeout is not None else "their collective timeout"
    return RankTimeoutError(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} exceeded "
                            f"{limit} and {'were' if len(ranks) > 1 else 'was'} killed\n\n"
                            + "\n\n".join(parts), ranks)


_last_worker_pids: List[int] = []


def last_worker_pids() -> List[int]:
    """Process ids of the rank workers of the latest run() (all gone once it returns)."""
    return list(_last_worker_pids)


def _assemble(rows, num_proc: int) -> List[Any]:
    parts: Dict[int, Dict[int, bytes]] = {}
    totals: Dict[int, int] = {}
    for row in rows:
        parts.setdefault(row["rank"], {})[row["part"]] = bytes(row["data"])
        totals[row["rank"]] = row["parts"]
    results = []
    for rank in range(num_proc):
        got = parts.get(rank, {})
        if len(got) != totals.get(rank, -1):
            raise SparkRingError(f"rank {rank}'s result came back incomplete "
                                 f"({len(got)} of {totals.get(rank)} chunks)")
        results.append(cloudpickle.loads(b"".join(got[i] for i in range(len(got)))))
    return results
