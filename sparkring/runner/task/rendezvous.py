"""Where one task meets the others before its rank starts, in one of three ways, each a function.

- **as a gang** (dynamic allocation: an ordinary stage, no task infos): every task reaches the driver,
  says where it is reached, and the driver gathers the records;
- **in a barrier stage, live**: the barrier's task infos say where each task runs; the driver gathers
  the records (milliseconds), or Spark's allGather does where the driver says so;
- **detached** (some task cannot reach the driver): after either of the above, task 0 hosts a relay
  through which the tasks stop each other.

The context is BarrierTaskContext, a gang task's view of its TaskContext (gang.GangContext), or one
rank's view of a task that runs several (gang.RankContext): all three answer ``TaskContext``.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol

from ...collective import environment
from ...collective.ports import free_ports
from ...errors import ChannelError, ConfigurationError
from .. import channel, protocol
from ..gpus import cuda_names
from ..protocol import Abort, Detached, Hello, Rendezvous, TaskSpec
from ..versions import package_versions
from .network import resolve
from .outbox import Relay


class TaskContext(Protocol):
    """The calls of pyspark's BarrierTaskContext that a task's rendezvous and its end make."""

    def partitionId(self) -> int:  # noqa: N802 - BarrierTaskContext's names
        """This task's (or rank's) index in the stage."""

    def taskAttemptId(self) -> int:  # noqa: N802
        """Spark's id of this task attempt (a retried stage's are larger)."""

    def stageId(self) -> int:  # noqa: N802
        """The stage's id."""

    def resources(self) -> Dict[str, Any]:
        """The resources Spark gave the task (its GPUs)."""

    def getTaskInfos(self) -> List[Any]:  # noqa: N802
        """Each task's executor address, in partition order."""

    def allGather(self, message: str = "") -> List[str]:  # noqa: N802
        """Every task's message, in partition order."""

    def barrier(self) -> None:
        """Wait until every task gets here."""


@dataclass
class Joined:
    """A task that has met the others: where every rank runs, the stage attempt, the channels.

    >>> joined = rendezvous(BarrierTaskContext.get(), spec)  # doctest: +SKIP
    >>> joined.hosts[joined.rank], joined.live  # doctest: +SKIP
    ('10.0.0.7', True)
    """

    rank: int
    executors: List[str]            # host:port of each task's executor
    addresses: List[str]            # where each task is reached
    hosts: List[str]                # which host each task is on: ranks of one host share it (local ranks)
    my_ip: str
    ports: List[int]                # rank 0's: the rendezvous store's, torch's MASTER_PORT
    gathered: List[Rendezvous]
    attempt: int
    live: bool
    driver: Optional[channel.Connection]
    control: Optional[channel.Connection] = None  # the relay of a detached run
    relay: Optional[Relay] = None                # task 0's, on a detached run

    def close(self) -> None:
        """Close this task's channels (and task 0's relay)."""
        for conn in (self.driver, self.control):
            if conn is not None:
                conn.close()
        if self.relay is not None:
            self.relay.server.close()


@dataclass(frozen=True)
class _Met:
    """What meeting gave, before the stage attempt and the hosts are worked out from it."""

    executors: List[str]
    addresses: List[str]
    my_ip: str
    gathered: List[Rendezvous]


def rendezvous(ctx: TaskContext, spec: TaskSpec) -> Joined:
    """Meet the other tasks: each says what the others need (Rendezvous), all go live or all go
    detached (then task 0 hosts a relay).

    >>> rendezvous(BarrierTaskContext.get(), spec).attempt  # doctest: +SKIP
    4
    """
    driver = _connect_driver(spec)
    met = _meet_as_gang(ctx, spec, driver) if spec.gang else _meet_in_barrier(ctx, spec, driver)
    gathered = met.gathered
    ports = gathered[0].ports
    assert ports is not None  # rank 0 chose them
    # executors name their host by address; one that says otherwise (several simulated on one machine) is believed
    hosts = [g.host_id or address for g, address in zip(gathered, met.addresses)]
    joined = Joined(rank=ctx.partitionId(), executors=met.executors, addresses=met.addresses, hosts=hosts,
                    my_ip=met.my_ip, ports=ports, gathered=gathered,
                    # every task of one stage attempt computes the same key; a retried stage gets a larger one
                    attempt=min(g.task_attempt_id for g in gathered),
                    live=all(g.live for g in gathered), driver=driver)
    if not joined.live:
        _go_detached(ctx, spec, joined)
    return joined


def _meet_as_gang(ctx: TaskContext, spec: TaskSpec, driver: Optional[channel.Connection]) -> _Met:
    """No task infos: each task says where it is reached (the address it reached the driver from)."""
    rank = ctx.partitionId()
    if driver is None:
        raise RuntimeError(f"rank {rank} cannot reach the driver at {spec.driver_host}:{spec.driver_port}; "
                           "under dynamic allocation the ranks meet only there")
    my_ip = driver.sock.getsockname()[0]
    driver.send(protocol.Arrived(rank=rank))
    gathered = _gather(ctx, spec, driver, _record(ctx, spec, my_ip, live=True, address=my_ip))
    addresses = [str(g.address) for g in gathered]
    return _Met(executors=list(addresses), addresses=addresses, my_ip=my_ip, gathered=gathered)


def _meet_in_barrier(ctx: TaskContext, spec: TaskSpec, driver: Optional[channel.Connection]) -> _Met:
    """The barrier's task infos say where each task runs; the records meet through the driver or allGather."""
    rank = ctx.partitionId()
    executors = [info.address for info in ctx.getTaskInfos()]
    addresses = [address.rsplit(":", 1)[0].strip("[]") for address in executors]
    my_ip = resolve(addresses[rank])
    if driver is not None:
        driver.send(protocol.Arrived(rank=rank))
    gathered = _gather(ctx, spec, driver, _record(ctx, spec, my_ip, live=driver is not None, address=None))
    return _Met(executors=executors, addresses=addresses, my_ip=my_ip, gathered=gathered)


def _record(ctx: TaskContext, spec: TaskSpec, my_ip: str, *, live: bool, address: Optional[str]) -> Rendezvous:
    """What this task tells the others: rank 0's ports, its attempt, versions, GPUs, host."""
    gpu_error: Optional[str] = None
    own_gpus: Optional[List[str]] = None
    try:
        own_gpus = _own_gpus(ctx) if spec.use_gpu else None
    except ConfigurationError as exc:
        gpu_error = str(exc)
    # two ports on rank 0's host: sparkring's rendezvous store, and torch's MASTER_PORT for
    # user code that calls init_process_group itself (env://, the torchrun way)
    return Rendezvous(ports=free_ports(my_ip, 2) if ctx.partitionId() == 0 else None,
                      task_attempt_id=ctx.taskAttemptId(), live=live, versions=package_versions(), gpus=own_gpus,
                      gpu_error=gpu_error, host_id=os.environ.get(environment.HOST_ID) or None, address=address)


def _gather(ctx: TaskContext, spec: TaskSpec, driver: Optional[channel.Connection],
            mine: Rendezvous) -> List[Rendezvous]:
    """Every task's record: through the driver where it answers, else Spark's allGather (which a
    gang's context refuses, saying why)."""
    gathered = _gather_through_driver(ctx, driver, mine, spec) if driver is not None else None
    if gathered is not None:
        return gathered
    return [Rendezvous.from_json(text) for text in _all_gather(ctx, mine.to_json(), spec.start_timeout, spec.num_proc)]


def _go_detached(ctx: TaskContext, spec: TaskSpec, joined: Joined) -> None:
    """Some task cannot reach the driver: every task goes quiet there, task 0 hosts the relay, all connect to it."""
    if joined.driver is not None:  # this task got through, another did not: tell the driver why it goes quiet
        joined.driver.send(Detached(rank=joined.rank, attempt=joined.attempt))
        joined.driver.close()
        joined.driver = None
    joined.relay = Relay(joined.my_ip, spec.secret) if joined.rank == 0 else None
    relay_port = int(_all_gather(ctx, str(joined.relay.server.address[1] if joined.relay else 0),
                                 spec.start_timeout, spec.num_proc)[0])
    joined.control = channel.connect(resolve(joined.addresses[0]), relay_port, spec.secret, timeout=spec.start_timeout)
    joined.control.send(Hello(rank=joined.rank))


def _gather_through_driver(ctx: TaskContext, driver: channel.Connection, mine: Rendezvous,
                           spec: TaskSpec) -> Optional[List[Rendezvous]]:
    """Every rank's record, gathered by the driver (milliseconds, where Spark's allGather takes
    about a second); None when the driver says to use allGather (a task cannot reach it) or
    goes away."""
    driver.send(protocol.Join(rank=ctx.partitionId(), stage=ctx.stageId(), record=mine))
    driver.sock.settimeout(spec.start_timeout)
    try:
        while True:
            frame = driver.recv()
            if frame is None:
                return None
            if isinstance(frame, protocol.Gathered):
                return frame.records
            if isinstance(frame, Abort):
                raise RuntimeError(f"rank {ctx.partitionId()} was stopped before it started: {frame.reason}")
    except OSError:  # a timeout: the driver is stuck; Spark's allGather decides
        return None
    finally:
        driver.sock.settimeout(None)


def _all_gather(ctx: TaskContext, message: str, timeout: float, num_proc: int) -> List[str]:
    """BarrierTaskContext.allGather that gives up after ``timeout`` seconds."""
    box: Dict[str, object] = {}

    def gather():
        try:
            box["out"] = list(ctx.allGather(message))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    thread = threading.Thread(target=gather, daemon=True)
    thread.start()
    thread.join(timeout)
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    if "out" not in box:
        raise TimeoutError(f"not all {num_proc} ranks reached the rendezvous within start_timeout="
                           f"{timeout:g}s; the cluster may lack free slots or executors are still starting")
    return box["out"]  # type: ignore[return-value]


def _connect_driver(spec: TaskSpec) -> Optional[channel.Connection]:
    if not spec.stream:
        return None
    try:
        return channel.connect(spec.driver_host, spec.driver_port, spec.secret, timeout=spec.connect_timeout)
    except (OSError, ChannelError):
        return None


def _own_gpus(ctx: TaskContext) -> Optional[List[str]]:
    """The GPUs Spark gave this task, as CUDA names (None in local mode: the driver's GPUs are
    handed out by local rank once every task's place is known)."""
    resources = ctx.resources()
    if "gpu" in resources and resources["gpu"].addresses:
        return cuda_names(list(resources["gpu"].addresses))
    return None
