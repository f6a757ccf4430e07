"""The body of one barrier task: meet the others (rendezvous.py), start the rank's worker process, relay its
stop it when the run is aborted or times out, and return its result (or what went wrong) as the
stage's output records.

Messages a task has for the driver go over the live channel when every task can reach the
driver; otherwise the run is *detached*: task 0 hosts a relay through which the tasks stop each
other, and logs, events and errors come back in the output records when the stage ends."""
from __future__ import annotations

import os
import shutil
import sys
import threading
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

from ...collective import environment
from ...collective.hosting import transport
from ...errors import ChannelError, ConfigurationError
from .. import channel, protocol
from ..failures import is_secondary
from ..gpus import (
    SHARED_GPU_FALLBACK,
    VISIBLE,
    HostGpus,
    backend_on_shared_gpus,
    cuda_names,
    discover_gpus,
    host_gpus,
)
from ..protocol import (
    Abort,
    Beat,
    Cause,
    Done,
    Error,
    Hello,
    Log,
    OutputRecord,
    Rendezvous,
    Stacks,
    Started,
    TaskSpec,
)
from ..versions import skew, skew_message
from .gang import STOPPED_MARK, GangContext, TaskRanks
from .mpi import mpi_launch_env, mpi_shm_segments, remove_orphan_segments
from .network import interface_of, resolve
from .outbox import Outbox
from .rank import RankProcess, supervise
from .rendezvous import Joined, TaskContext, rendezvous
from .workdir import WorkDir

_STARTING = threading.Lock()


def _rank_layout(hosts: List[str], rank: int) -> Tuple[int, int, int, int]:
    same_host = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    unique_hosts = list(dict.fromkeys(hosts))
    return (same_host.index(rank), len(same_host), unique_hosts.index(hosts[rank]), len(unique_hosts))


@dataclass(frozen=True)
class RingGpus:
    """Every rank's view of the run's GPUs, computed alike by every task from the rendezvous."""

    by_host: Dict[str, HostGpus]
    backend: str                    # the plan's backend, or gloo where "auto" chose nccl on shared GPUs


def _ring_gpus(spec: TaskSpec, hosts: List[str], gathered: List[Rendezvous]) -> RingGpus:
    driver_gpus = list(spec.driver_gpus)
    if not driver_gpus and spec.driver_gpu_script and any(g.gpus is None for g in gathered):
        driver_gpus = cuda_names(discover_gpus(spec.driver_gpu_script))
    by_host: Dict[str, HostGpus] = {}
    for host in dict.fromkeys(hosts):
        ranks = [r for r, h in enumerate(hosts) if h == host]
        names: List[List[str]] = [
            list(own) if own is not None else ([driver_gpus[i % len(driver_gpus)]] if driver_gpus else [])
            for i, own in enumerate(gathered[r].gpus for r in ranks)]
        by_host[host] = host_gpus(names)
    shared = [h for h, g in by_host.items() if g.shared]
    backend = spec.backend
    if shared:
        backend = backend_on_shared_gpus(backend, spec.backend_from_auto, where=f"ranks on host(s) {shared}",
                                         why=" (they were given the same GPU)")
    return RingGpus(by_host=by_host, backend=backend)


def _check_versions(spec: TaskSpec, executors: List[str], gathered: List[Rendezvous]) -> None:
    """Every task compares every executor's versions with the driver's: all refuse alike."""
    if not spec.driver_versions:
        return
    lines = skew(spec.driver_versions, {f"executor {e}": g.versions for e, g in zip(executors, gathered)})
    if lines:
        raise ConfigurationError(skew_message(lines))


def _gpu_plan(spec: TaskSpec, hosts: List[str], gathered: List[Rendezvous]) -> Optional[RingGpus]:
    if not spec.use_gpu:
        return None
    failed = [(r, g.gpu_error) for r, g in enumerate(gathered) if g.gpu_error]
    if failed:
        rank, message = failed[0]
        raise ConfigurationError(f"rank {rank}: {message}")
    return _ring_gpus(spec, hosts, gathered)


def _rank_env(spec: TaskSpec, gpus: Optional[RingGpus], joined: Joined, workdir: WorkDir) -> Dict[str, str]:
    rank, hosts = joined.rank, joined.hosts
    local_rank, local_size, cross_rank, cross_size = _rank_layout(hosts, rank)
    host_gpus_ = gpus.by_host[hosts[rank]] if gpus is not None else None
    place = environment.RankEnv(
        rank=rank, size=spec.num_proc, local_rank=local_rank, local_size=local_size, cross_rank=cross_rank,
        cross_size=cross_size, master_addr=resolve(joined.addresses[0]), master_port=joined.ports[0],
        torch_port=joined.ports[1], run_id=str(joined.attempt),
        backend=gpus.backend if gpus is not None else spec.backend, secret=spec.secret.hex(),
        attempt=joined.attempt, start_timeout=spec.start_timeout, parent_pid=os.getpid(),
        # a rank blocked in a collective fails with the run's timeout, not gloo's 30 minutes
        timeout=spec.timeout,
        driver=f"{spec.driver_host}:{spec.driver_port}" if joined.live else None,
        event_file=None if joined.live else workdir.events,
        gpu=host_gpus_.ordinals[local_rank] if host_gpus_ is not None else None)
    env = dict(os.environ)
    env.update({k: str(v) for k, v in spec.env.items()})
    for stale in (environment.DRIVER, environment.EVENT_FILE, environment.GPU):
        env.pop(stale, None)
    env.update(place.to_env())
    # Everything this task can import, the worker can import (py-files, zips, tests).
    env.update({"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PYTHONUNBUFFERED": "1"})
    iface = interface_of(joined.my_ip)
    if iface:
        env.setdefault("GLOO_SOCKET_IFNAME", iface)
        env.setdefault("NCCL_SOCKET_IFNAME", iface)
    if transport(spec.backend).starts_under_mpiexec:
        for key, value in mpi_launch_env(iface, joined.my_ip).items():
            env.setdefault(key, value)
    env.setdefault("OMP_NUM_THREADS", str(max(1, spec.task_cpus)))
    if host_gpus_ is not None:
        env[VISIBLE] = ",".join(host_gpus_.visible)
    else:
        env.setdefault(VISIBLE, "")
    return env


def _records(rank: int, outbox: Outbox, result: Optional[bytes], chunk: int) -> Iterator[OutputRecord]:
    for frame in outbox.drain():
        yield OutputRecord.message(rank, frame)
    if result is not None:
        yield from OutputRecord.result_chunks(rank, result, chunk)


def _ring_checks(spec: TaskSpec, joined: Joined, outbox: Outbox) -> Optional[RingGpus]:
    """Version skew and GPU layout, decided alike on every task: a refusal fails every task."""
    rank, attempt = joined.rank, joined.attempt
    try:
        _check_versions(spec, joined.executors, joined.gathered)
        gpus = _gpu_plan(spec, joined.hosts, joined.gathered)
    except ConfigurationError as exc:
        refused = Error(rank=rank, attempt=attempt, kind=protocol.EXIT, traceback=str(exc))
        outbox.send(refused)
        joined.close()
        raise RuntimeError(f"rank {rank} cannot start {protocol.embed_error(refused)}: {exc}") from None
    if gpus is not None and rank == 0 and gpus.backend != spec.backend:
        outbox.send(Log(rank=rank, attempt=attempt, stream="stderr",
                        line=f"sparkring: {SHARED_GPU_FALLBACK}"))
    return gpus


class _Heartbeat:
    """From the task's Hello until its end: a Beat to the driver every beat interval, from a
    thread of this task's process (a rank busy holding its own interpreter still beats)."""

    def __init__(self, spec: TaskSpec, joined: Joined):
        self.ended = threading.Event()
        if joined.driver is not None and spec.heartbeat_timeout is not None:
            interval = protocol.beat_interval(spec.heartbeat_timeout)
            threading.Thread(target=self._beat, args=(joined.driver, Beat(rank=joined.rank, attempt=joined.attempt),
                                                      interval), name="sparkring-beat", daemon=True).start()

    def _beat(self, conn: channel.Connection, frame: Beat, interval: float) -> None:
        while not self.ended.wait(interval) and conn.send(frame):
            pass

    def stop(self) -> None:
        """No more beats (the task ends)."""
        self.ended.set()


class _Supervisor:
    """Follows a running rank: relays its output, obeys Abort and Cause frames from the driver
    or the relay, and kills it past the run's timeout."""

    def __init__(self, spec: TaskSpec, joined: Joined, outbox: Outbox):
        self.spec, self.joined, self.outbox = spec, joined, outbox
        self.aborted: Dict[str, str] = {}
        self.cause: List[Error] = []
        self.cause_known = threading.Event()
        self.died_first = threading.Event()
        self.timed_out = False

    def relay(self, stream: str, line: str) -> None:
        self.outbox.send(Log(rank=self.joined.rank, attempt=self.joined.attempt, stream=stream, line=line))

    def listen(self, conn: channel.Connection, worker: RankProcess) -> None:
        rank, attempt = self.joined.rank, self.joined.attempt
        try:
            while True:
                msg = conn.recv()
                if msg is None:
                    if conn is self.joined.control and worker.running():  # task 0 is gone: so is the stage
                        self.aborted.setdefault("reason", "task 0 of the stage is gone")
                        worker.kill()
                    return
                if isinstance(msg, Cause):
                    self.cause.append(msg.error)
                    self.cause_known.set()
                elif isinstance(msg, Abort) and not self.aborted:
                    if worker.failed():
                        # this rank had died already (a peer's "connection closed" beat its
                        # report to the driver): it is the cause, and still reports its end
                        self.died_first.set()
                    self.aborted["reason"] = msg.reason or "the run was aborted"
                    if msg.dump:
                        self.outbox.send(Stacks(rank=rank, attempt=attempt, stacks=worker.dump_stacks()))
                    worker.kill()
        except (OSError, ChannelError, ValueError):
            return

    def follow(self, worker: RankProcess) -> None:
        """Until the worker ends (or is killed past the timeout), with its output relayed."""
        for conn in (self.joined.driver, self.joined.control):
            if conn is not None:
                threading.Thread(target=self.listen, args=(conn, worker), daemon=True).start()
        self.timed_out = bool(supervise([worker], self.spec.timeout))
        worker.output_done()
        for event in worker.events():  # what a detached rank reported goes out as records
            self.outbox.send(event)

    def error(self, worker: RankProcess) -> Optional[Error]:
        """How the rank ended, if badly (raises where Spark should rerun the stage instead)."""
        rank, attempt = self.joined.rank, self.joined.attempt
        if self.timed_out:
            return Error(rank=rank, attempt=attempt, kind=protocol.TIMEOUT,
                         traceback=(f"rank {rank} exceeded timeout={self.spec.timeout:g}s and was killed; "
                                    f"where its threads were:\n{worker.stacks}"))
        if self.aborted and self.spec.attempts > 1 and not self.died_first.is_set():
            raise RuntimeError(f"rank {rank} {STOPPED_MARK}: {self.aborted['reason']}")
        if (not self.aborted or self.died_first.is_set()) and worker.failed():
            tb = worker.failure()
            raised, message = worker.raised()
            return Error(rank=rank, attempt=attempt, kind=protocol.EXIT, exit_code=worker.returncode, traceback=tb,
                         secondary=is_secondary(tb), exception_type=raised, message=message)
        return None

    def report(self, error: Error) -> None:
        """Send the error; with stage attempts left, fail the task so Spark reruns the stage."""
        self.outbox.send(error)
        if self.spec.attempts > 1:
            reported = error
            if self.joined.control is not None and error.secondary and self.cause_known.wait(3.0):
                reported = self.cause[0]  # Spark shows one task's failure: make it the cause
            raise RuntimeError(f"rank {error.rank} failed {protocol.embed_error(reported)}:\n{reported.traceback}")


def run_task(spec: TaskSpec) -> Iterator[OutputRecord]:
    """Run this task's ranks (one, or ``spec.ranks_per_task`` side by side); yields the stage's
    output records."""
    from pyspark import BarrierTaskContext

    ctx: TaskContext
    if spec.gang:
        from pyspark import TaskContext

        ctx = GangContext(TaskContext.get())
    else:
        ctx = BarrierTaskContext.get()
    if spec.ranks_per_task == 1:
        yield from _run_rank(ctx, spec)
    else:
        yield from TaskRanks(ctx, spec.ranks_per_task).run(lambda view: list(_run_rank(view, spec)))


def _run_rank(ctx: TaskContext, spec: TaskSpec) -> Iterator[OutputRecord]:
    """Run one rank: ``ctx`` is the barrier task's context, or one rank's view of it."""
    joined = rendezvous(ctx, spec)
    rank, attempt = joined.rank, joined.attempt
    outbox = Outbox(joined.driver, joined.control)
    outbox.send(Hello(rank=rank, attempt=attempt, host=joined.hosts[rank], executor=joined.executors[rank]))
    heartbeat = _Heartbeat(spec, joined)
    try:
        yield from _start_and_follow(ctx, spec, joined, outbox)
    finally:
        heartbeat.stop()


def _start_and_follow(ctx: TaskContext, spec: TaskSpec, joined: Joined, outbox: Outbox) -> Iterator[OutputRecord]:
    """The rank's worker from start to end, then its records (the task has said Hello)."""
    rank, attempt = joined.rank, joined.attempt
    gpus = _ring_checks(spec, joined, outbox)
    workdir = WorkDir.create(rank)
    env = _rank_env(spec, gpus, joined, workdir)
    worker: Optional[RankProcess] = None
    shm_before = None
    if transport(spec.backend).starts_under_mpiexec:
        remove_orphan_segments(set(), older_than_s=60.0)  # what killed tasks of earlier runs left
        shm_before = mpi_shm_segments()
    try:
        supervisor = _Supervisor(spec, joined, outbox)
        with _STARTING:  # a task's ranks fork one at a time
            worker = RankProcess(rank, workdir, spec.payload, env, supervisor.relay)
        outbox.send(Started(rank=rank, attempt=attempt, pid=worker.pid))
        supervisor.follow(worker)
        error = supervisor.error(worker)
        if error is not None:
            supervisor.report(error)
        result = None
        if error is None and not supervisor.aborted:
            result = worker.result()
            outbox.send(Done(rank=rank, attempt=attempt))
        if joined.control is not None:
            # Detached: task 0's relay must outlive every rank, so the tasks leave together.
            ctx.barrier()
        yield from _records(rank, outbox, result, spec.chunk_bytes)
    finally:
        _clean_up(worker, shm_before, workdir)
        joined.close()


def _clean_up(worker: Optional[RankProcess], shm_before, workdir: WorkDir) -> None:
    """The worker and anything it left behind: its process group, MPI segments, its directory."""
    if worker is not None:
        worker.close()
    if shm_before is not None:
        if worker is not None:
            try:
                worker.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - leave the segments of a process that will not go
                pass
        remove_orphan_segments(shm_before)
    shutil.rmtree(workdir.path, ignore_errors=True)


def stage_function(spec: TaskSpec):
    """The function ``mapInArrow`` runs (a barrier stage, or an ordinary one under dynamic
    allocation): one task, its ranks."""

    def task(batches):
        for _ in batches:  # the input is spark.range: nothing to read
            pass
        for record in run_task(spec):
            yield record.to_arrow()

    return task
