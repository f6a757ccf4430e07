"""``run()``: execute a function (or script) once per rank in a Spark barrier stage."""
from __future__ import annotations

import importlib.util
import os
import runpy
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import cloudpickle

from . import cluster
from ._task import TaskSpec, run_task
from .channel import DriverChannel
from .errors import ConfigurationError, RankFailedError, RankTimeoutError, SparkRingError

BACKENDS = ("auto", "gloo", "nccl", "mpi")


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
        with open(self.path) as f:  # fail on the driver, not on every rank
            f.read(1)

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
        self.arrived: set = set()
        self.timeouts: Dict[int, Dict[int, str]] = {}
        self.stacks: Dict[int, Dict[int, str]] = {}
        self.done: Dict[int, set] = {}
        self.errors: Dict[int, dict] = {}
        self.pids: List[int] = []
        self.channel: Optional[DriverChannel] = None

    def handle(self, msg: Dict[str, Any], conn) -> None:
        kind = msg.get("t")
        attempt = int(msg.get("attempt", 0))
        rank = int(msg.get("rank", -1))
        if kind == "arrived":
            with self.lock:
                self.arrived.add(rank)
        elif kind == "hello":
            conn.info.update(rank=rank, attempt=attempt, task=True)
            with self.lock:
                if attempt > self.attempt or not self.hello:
                    if attempt > self.attempt:
                        self.attempt_started = time.monotonic()
                    self.attempt = max(self.attempt, attempt)
                self.hello.setdefault(attempt, set()).add(rank)
        elif kind == "started":
            with self.lock:
                self.pids.append(int(msg["pid"]))
        elif kind == "log":
            self._print(rank, msg.get("stream"), msg.get("line", ""))
        elif kind == "event":
            if self.on_event is not None:
                try:
                    self.on_event(rank, msg.get("payload"))
                except Exception as exc:  # noqa: BLE001 - a progress bug must not kill training
                    print(f"sparkring: on_event callback failed: {exc!r}", file=self.err)
        elif kind == "stacks":
            with self.lock:
                self.stacks.setdefault(attempt, {})[rank] = msg.get("stacks", "")
        elif kind == "done":
            with self.lock:
                self.done.setdefault(attempt, set()).add(rank)
        elif kind == "error":
            with self.lock:
                if msg.get("kind") == "timeout":
                    self.timeouts.setdefault(attempt, {})[rank] = msg.get("traceback", "")
                first = attempt not in self.errors
                if first:
                    self.errors[attempt] = msg
            if first and self.channel is not None:
                timed_out = msg.get("kind") == "timeout"
                reason = f"rank {rank} exceeded its timeout" if timed_out else f"rank {rank} failed"
                self.channel.broadcast({"t": "abort", "reason": reason, "dump": timed_out},
                                       where=lambda c: c.info.get("task") and c.info.get("attempt") == attempt
                                       and c.info.get("rank") != rank)

    def _print(self, rank: int, stream: Optional[str], line: str) -> None:
        if self.verbose <= 0 or (self.verbose == 1 and rank != 0):
            return
        target = self.err if stream == "stderr" else self.out
        text = f"[{rank}] {line}" if self.verbose >= 2 else line
        with self.lock:
            print(text, file=target, flush=True)

    def first_error(self) -> Optional[dict]:
        with self.lock:
            if not self.errors:
                return None
            return self.errors[max(self.errors)]


def _active_spark():
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None:
        spark = SparkSession.builder.getOrCreate()
    return spark


def _driver_ip(sc) -> str:
    host = sc.getConf().get("spark.driver.host") or socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _check_mpi_installed() -> None:
    from ._task import find_mpiexec

    missing = [name for name, ok in (("mpi4py", importlib.util.find_spec("mpi4py") is not None),
                                     ("mpiexec", find_mpiexec() is not None)) if not ok]
    if missing:
        raise ConfigurationError(
            f"backend='mpi' needs {' and '.join(missing)} on the driver and every executor: "
            "pip install 'sparkring[mpi]' (mpi4py and the mpich wheel), or use backend='gloo'")


def run(fn: Union[Callable[..., Any], str], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
        num_proc: Optional[int] = None, backend: str = "auto", use_gpu: Optional[bool] = None,
        start_timeout: float = 120, timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
        verbose: int = 1, on_event: Optional[Callable[[int, Any], None]] = None) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` once per rank in a Spark barrier stage; return the
    results ordered by rank.

    ``fn`` may also be the path of a Python script, run as ``__main__`` with ``args`` as
    its command line (the Horovod ``horovodrun`` habit); each rank then returns 0.

    >>> import sparkring.collective as sr
    >>> def fn():
    ...     return sr.allreduce(torch.tensor([sr.rank()], dtype=torch.float32)).item()
    >>> run(fn, num_proc=2)  # doctest: +SKIP
    [0.5, 0.5]
    """
    if backend == "mpi":
        _check_mpi_installed()
    if backend not in BACKENDS:
        raise ConfigurationError(f"backend={backend!r} is not known; use one of {', '.join(BACKENDS)}")
    if timeout is not None and timeout <= 0:
        raise ConfigurationError(f"timeout={timeout}: it must be positive (seconds) or None")
    if isinstance(fn, (str, os.PathLike)):
        fn, args, kwargs = ScriptMain(str(fn), list(args)), (), None
    elif not callable(fn):
        raise ConfigurationError(f"fn must be a callable or a script path, got {type(fn).__name__}")
    spark = _active_spark()
    sc = spark.sparkContext
    if use_gpu is None:
        use_gpu = cluster.default_use_gpu(sc)
    if backend == "nccl" and not use_gpu:
        raise ConfigurationError("backend='nccl' needs GPUs: pass use_gpu=True (and schedule GPUs "
                                 "with spark.task.resource.gpu.amount), or use backend='gloo'")
    if num_proc is None:
        num_proc = cluster.task_slots(sc, use_gpu)
    cluster.check_session(sc, num_proc, use_gpu)

    payload = cloudpickle.dumps((fn, tuple(args), kwargs or {}))
    secret = os.urandom(32)
    state = _RunState(num_proc, verbose, on_event)
    driver_ip = _driver_ip(sc)
    channel = DriverChannel(driver_ip, secret, state.handle)
    state.channel = channel
    spec = TaskSpec(payload=payload, driver_host=driver_ip, driver_port=channel.address[1],
                    secret=secret, num_proc=num_proc, backend=backend, use_gpu=bool(use_gpu),
                    driver_gpus=cluster.driver_gpus(sc) if cluster.is_local(sc) else [],
                    start_timeout=float(start_timeout), timeout=timeout, env=dict(env or {}),
                    task_cpus=cluster.task_cpus(sc))
    group = f"sparkring-{uuid.uuid4().hex[:12]}"
    max_failures = cluster.task_max_failures(sc)
    outcome: Dict[str, Any] = {}

    def collect():
        try:
            sc.setJobGroup(group, f"sparkring.run: {num_proc} ranks", interruptOnCancel=True)
            rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(
                lambda rows: run_task(spec, rows))
            if max_failures > 1:
                # Spark never retries a failed barrier *result* stage, only a barrier map
                # stage: a shuffle after the ranks lets it rerun them (the driver caps the
                # attempts at spark.task.maxFailures).
                rdd = rdd.map(lambda chunk: (chunk[0], chunk)).partitionBy(1).values()
            outcome["chunks"] = rdd.collect()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            outcome["error"] = exc

    worker = threading.Thread(target=collect, name="sparkring-collect", daemon=True)
    started = time.monotonic()
    worker.start()
    try:
        failure: Optional[BaseException] = None
        while worker.is_alive():
            worker.join(0.1)
            now = time.monotonic()
            with state.lock:
                attempt = state.attempt
                greeted = state.hello.get(attempt, set())
                since = state.attempt_started if state.hello else started
            if len(greeted) < num_proc and now - since > start_timeout:
                missing = sorted(set(range(num_proc)) - (state.arrived if len(state.arrived) < num_proc
                                                          else greeted))
                failure = RankTimeoutError(
                    f"ranks {missing} did not start within start_timeout={start_timeout:g}s; the "
                    "cluster may lack free slots (other jobs running?) or executors are still starting",
                    missing)
            elif timeout is not None and now - since > start_timeout + timeout + 30:
                running = sorted(set(range(num_proc)) - state.done.get(attempt, set()))
                failure = RankTimeoutError(f"ranks {running} exceeded timeout={timeout:g}s", running)
            with state.lock:
                failed_attempts = len(state.errors)
            if failure is None and max_failures > 1 and failed_attempts >= max_failures:
                err = state.first_error()
                failure = _rank_failed(err)
            if failure is not None:
                channel.broadcast({"t": "abort", "reason": str(failure)})
                sc.cancelJobGroup(group)
                worker.join(30)
                raise failure
        if "error" in outcome:
            err = state.first_error()
            if err is not None:
                if err.get("kind") == "timeout":
                    raise _timeout_error(state, num_proc, timeout) from None
                raise _rank_failed(err) from None
            raise SparkRingError(f"the barrier stage failed before any rank reported: {outcome['error']}") \
                from outcome["error"]
    finally:
        channel.close()
        _last_worker_pids[:] = state.pids
    return _assemble(outcome["chunks"], num_proc)


def _rank_failed(err: Dict[str, Any]) -> RankFailedError:
    return RankFailedError(int(err.get("rank", -1)), err.get("traceback", ""), err.get("exit_code"))


def _timeout_error(state: _RunState, num_proc: int, timeout: float) -> RankTimeoutError:
    """Name the ranks that ran out of time, with where every rank's threads were."""
    attempt = max(state.timeouts)
    deadline = time.monotonic() + 3  # the other ranks' stack dumps are on their way
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
    return RankTimeoutError(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} exceeded "
                            f"timeout={timeout:g}s and {'were' if len(ranks) > 1 else 'was'} killed\n\n"
                            + "\n\n".join(parts), ranks)


_last_worker_pids: List[int] = []


def last_worker_pids() -> List[int]:
    """Process ids of the rank workers of the latest run() (all gone once it returns)."""
    return list(_last_worker_pids)


def _assemble(chunks, num_proc: int) -> List[Any]:
    parts: Dict[int, Dict[int, bytes]] = {}
    totals: Dict[int, int] = {}
    for rank, index, total, data in chunks:
        parts.setdefault(rank, {})[index] = data
        totals[rank] = total
    results = []
    for rank in range(num_proc):
        got = parts.get(rank, {})
        if len(got) != totals.get(rank, -1):
            raise SparkRingError(f"rank {rank}'s result came back incomplete "
                                 f"({len(got)} of {totals.get(rank)} chunks)")
        results.append(cloudpickle.loads(b"".join(got[i] for i in range(len(got)))))
    return results
