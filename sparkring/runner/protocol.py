"""What the runner's parts say to each other, as types: what the driver gives every task
(``TaskSpec``), the channel frames between a rank's worker, its barrier task, task 0's relay and
the driver, the rendezvous record every task shares in the barrier's allGather, and the stage's
output records (``OutputRecord``). One encode/decode for each: a frame is a JSON object whose
``t`` names its type on the wire, and nowhere else.

A frame that arrives over the channel, from the stage's output records or embedded in a
task's exception text decodes to the same object, so the driver handles all three alike.
"""
from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Dict, List, Optional, Type, Union

TIMEOUT, EXIT, EXCEPTION = "timeout", "exit", "exception"  # Error.kind


@dataclass(frozen=True)
class Arrived:
    """A task reached the driver, before the rendezvous (the driver counts who got through)."""

    TAG: ClassVar[str] = "arrived"
    rank: int


@dataclass(frozen=True)
class Hello:
    """A task joined the run in a stage attempt (to the driver) or the relay (``attempt`` unused)."""

    TAG: ClassVar[str] = "hello"
    rank: int
    attempt: int = 0
    host: str = ""
    executor: str = ""  # the Spark executor's address (host:port) that runs the task


@dataclass(frozen=True)
class Detached:
    """Another task cannot reach the driver: this one goes quiet too (results come at the end)."""

    TAG: ClassVar[str] = "detached"
    rank: int
    attempt: int


@dataclass(frozen=True)
class Started:
    """The rank's worker process runs."""

    TAG: ClassVar[str] = "started"
    rank: int
    attempt: int
    pid: int


@dataclass(frozen=True)
class Log:
    """One line the rank's worker printed."""

    TAG: ClassVar[str] = "log"
    rank: int
    attempt: int
    stream: str
    line: str


@dataclass(frozen=True)
class Event:
    """What code in a rank reported (``report()``): the training loop's progress, or a user's."""

    TAG: ClassVar[str] = "event"
    payload: Any
    rank: int = 0
    attempt: int = 0


@dataclass(frozen=True)
class Beat:
    """Task to driver, every few seconds while its rank runs: the task's host still reaches the
    driver. The task's own process sends it, never the rank's, so a rank busy in a long step or
    validation still beats; only an unreachable host or a frozen executor falls silent."""

    TAG: ClassVar[str] = "beat"
    rank: int
    attempt: int


@dataclass(frozen=True)
class Stacks:
    """Where a rank's threads were when the run was stopped for a timeout."""

    TAG: ClassVar[str] = "stacks"
    rank: int
    attempt: int
    stacks: str


@dataclass(frozen=True)
class Done:
    """The rank finished and its result is in the stage's output."""

    TAG: ClassVar[str] = "done"
    rank: int
    attempt: int


@dataclass(frozen=True)
class Error:
    """A rank failed: its code raised (``exception``), its process ended badly (``exit``) or it ran
    out of time (``timeout``). ``secondary``: it only lost a peer that failed first."""

    TAG: ClassVar[str] = "error"
    rank: int
    attempt: int
    kind: str
    traceback: str
    exit_code: Optional[int] = None
    secondary: bool = False
    exception_type: Optional[str] = None  # errors.type_name() of what the rank's code raised (kind EXCEPTION)
    message: Optional[str] = None  # its str()


@dataclass(frozen=True)
class Abort:
    """Driver or relay to tasks: stop your rank (``dump``: send its stacks first)."""

    TAG: ClassVar[str] = "abort"
    reason: str
    dump: bool = False


@dataclass(frozen=True)
class Cause:
    """Relay to tasks: the error that started a detached run's failure."""

    TAG: ClassVar[str] = "cause"
    error: Error


@dataclass(frozen=True)
class ConnectionClosed:
    """What a channel tells its own handler when a peer's connection ends; never on the wire."""

    TAG: ClassVar[str] = "connection-closed"


@dataclass(frozen=True)
class Join:
    """Task to driver: this rank's Rendezvous record, to be gathered by the driver (a Spark
    barrier allGather costs about a second: its first caller polls once a second)."""

    TAG: ClassVar[str] = "join"
    rank: int
    stage: int
    record: "Rendezvous"


@dataclass(frozen=True)
class Gathered:
    """Driver to tasks: every rank's record, by rank; None: gather through Spark's allGather
    instead (some task did not join in time: it cannot reach the driver)."""

    TAG: ClassVar[str] = "gathered"
    records: Optional[List["Rendezvous"]]


@dataclass(frozen=True)
class Probe:
    """Rank to driver: characters to time the rank's link to the driver by (``measure_link``); the
    driver answers ProbeReceived as soon as they arrived."""

    TAG: ClassVar[str] = "probe"
    data: str
    rank: int = 0


@dataclass(frozen=True)
class ProbeReceived:
    """Driver to rank: the Probe's ``size`` characters arrived."""

    TAG: ClassVar[str] = "probe-received"
    size: int


Frame = Union[Arrived, Hello, Detached, Started, Log, Event, Beat, Stacks, Done, Error, Abort, Cause, Join,
              Gathered, Probe, ProbeReceived, ConnectionClosed]
_WIRE: Dict[str, Type[Any]] = {cls.TAG: cls for cls in (Arrived, Hello, Detached, Started, Log, Event, Beat, Stacks,
                                                         Done, Error, Abort, Cause, Join, Gathered, Probe,
                                                         ProbeReceived)}


def to_wire(frame: Frame) -> Dict[str, Any]:
    """The JSON object of a frame.

    >>> to_wire(Done(rank=1, attempt=7))
    {'t': 'done', 'rank': 1, 'attempt': 7}
    """
    if isinstance(frame, ConnectionClosed):
        raise ValueError("ConnectionClosed never travels")
    return {"t": frame.TAG, **asdict(frame)}


def from_wire(obj: Dict[str, Any]) -> Frame:
    """The frame a JSON object holds; ValueError for an unknown type or missing fields.

    >>> from_wire({"t": "abort", "reason": "rank 1 failed"})
    Abort(reason='rank 1 failed', dump=False)
    """
    cls = _WIRE.get(obj.get("t", "")) if isinstance(obj, dict) else None
    if cls is None:
        raise ValueError(f"not a sparkring frame: {str(obj)[:80]}")
    known = {f.name for f in fields(cls)}
    values = {k: v for k, v in obj.items() if k in known}
    if cls is Cause:
        values["error"] = from_wire({**values["error"], "t": Error.TAG})
    elif cls is Join:
        values["record"] = Rendezvous(**values["record"])
    elif cls is Gathered and values.get("records") is not None:
        values["records"] = [Rendezvous(**r) for r in values["records"]]
    try:
        return cls(**values)
    except TypeError as exc:
        raise ValueError(f"malformed {cls.TAG} frame: {exc}") from None


def dumps(frame: Frame) -> bytes:
    """``frame`` as compact JSON bytes."""
    return json.dumps(to_wire(frame), separators=(",", ":")).encode()


def loads(data: Union[bytes, str]) -> Frame:
    """The frame ``dumps`` made."""
    return from_wire(json.loads(data))


ERROR_MARK = "SPARKRING-ERROR"


def embed_error(error: Error) -> str:
    """An error inside a task's exception text: the driver reads it back from Spark's job
    failure when no channel and no output records carry it (a retried stage's last attempt on
    a detached run).

    >>> found_error("Task failed: " + embed_error(Error(1, 0, EXIT, "boom"))).traceback
    'boom'
    """
    return f"{ERROR_MARK}[{base64.b64encode(dumps(error)).decode()}]"


def found_error(text: str) -> Optional[Error]:
    """The last error embedded in ``text``, if any."""
    start = text.rfind(ERROR_MARK + "[")
    if start < 0:
        return None
    end = text.find("]", start)
    try:
        frame = loads(base64.b64decode(text[start + len(ERROR_MARK) + 1:end]))
    except ValueError:
        return None
    return frame if isinstance(frame, Error) else None


@dataclass(frozen=True)
class Rendezvous:
    """What each task tells every other in the barrier's first allGather.

    >>> r = Rendezvous(ports=[5000, 5001], task_attempt_id=3, live=True, versions={"torch": "2.13.0"})
    >>> Rendezvous.from_json(r.to_json()) == r
    True
    """

    ports: Optional[List[int]]         # rank 0's: the rendezvous store's and torch's MASTER_PORT
    task_attempt_id: int               # the smallest of a stage attempt keys that attempt
    live: bool                         # this task reached the driver's channel
    versions: Dict[str, str] = field(default_factory=dict)
    gpus: Optional[List[str]] = None   # the CUDA names Spark gave this task (None: local mode)
    gpu_error: Optional[str] = None    # why this task's GPU addresses cannot be used
    host_id: Optional[str] = None      # SPARKRING_HOST_ID of its executor: the host it groups with (else its address)
    address: Optional[str] = None      # where it is reached, said by a task of an ordinary stage (no task infos)

    def to_json(self) -> str:
        """The rendezvous as JSON (what a rank reads)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Rendezvous":
        """The rendezvous to_json() wrote."""
        return cls(**json.loads(text))


@dataclass
class TaskSpec:
    """What every task of a run gets in its closure (the plan's part the tasks need)."""

    payload: bytes
    driver_host: str
    driver_port: int
    secret: bytes
    num_proc: int
    backend: str
    use_gpu: bool
    driver_gpus: List[str]
    driver_gpu_script: Optional[str]
    start_timeout: float
    timeout: Optional[float]
    attempts: int
    stream: bool
    connect_timeout: float = 5.0
    env: Dict[str, str] = field(default_factory=dict)
    task_cpus: int = 1
    chunk_bytes: int = 8 * 1024 * 1024
    backend_from_auto: bool = False  # nccl chosen by backend="auto": gloo where ranks share a GPU
    driver_versions: Dict[str, str] = field(default_factory=dict)  # compared with every executor's
    ranks_per_task: int = 1         # ranks each task starts: task t runs ranks t*k .. t*k+k-1
    gang: bool = False              # an ordinary stage (dynamic allocation): the tasks meet only at the driver
    heartbeat_timeout: Optional[float] = None  # the driver's limit on a task's silence: each beats well within it


def beat_interval(heartbeat_timeout: float) -> float:
    """How often a task beats for a given heartbeat timeout: six beats to a timeout, between
    0.2 s and 5 s (a few lost or late beats never add up to a lost host).

    >>> beat_interval(30.0), beat_interval(0.5)
    (5.0, 0.2)
    """
    return min(5.0, max(0.2, heartbeat_timeout / 6))


RESULT, MESSAGE = "result", "message"  # OutputRecord.kind
# The output records' columns, in Spark's DDL types; the Arrow schema is derived from it.
_RECORD_COLUMNS = (("rank", "int"), ("kind", "string"), ("part", "int"), ("parts", "int"), ("data", "binary"))
RECORD_SCHEMA = ", ".join(f"{name} {kind}" for name, kind in _RECORD_COLUMNS)


@dataclass(frozen=True)
class OutputRecord:
    """One output record of the barrier stage: kind RESULT, a chunk (``part`` of ``parts``) of
    the rank's pickled result; kind MESSAGE, one frame (``dumps``) the driver handles as if it
    came live.

    >>> record = OutputRecord.message(1, Done(rank=1, attempt=0))
    >>> OutputRecord.from_row(record.to_row()) == record, record.frame()
    (True, Done(rank=1, attempt=0))
    """

    rank: int
    kind: str
    part: int
    parts: int
    data: bytes

    @classmethod
    def message(cls, rank: int, frame: Frame) -> "OutputRecord":
        """A record carrying rank ``rank``'s frame."""
        return cls(rank, MESSAGE, 0, 1, dumps(frame))

    @classmethod
    def result_chunks(cls, rank: int, result: bytes, chunk: int) -> List["OutputRecord"]:
        """Rank ``rank``'s pickled result as records of at most ``chunk`` bytes each."""
        total = max(1, -(-len(result) // chunk))
        return [cls(rank, RESULT, i, total, result[i * chunk:(i + 1) * chunk]) for i in range(total)]

    def frame(self) -> Frame:
        """The frame a message record carries."""
        return loads(self.data)

    def to_row(self) -> Dict[str, Any]:
        """The record as a Spark row's values, by column."""
        return {name: getattr(self, name) for name, _ in _RECORD_COLUMNS}

    @classmethod
    def from_row(cls, row: Any) -> "OutputRecord":
        """From a collected Spark Row (or a dict with the same keys)."""
        return cls(int(row["rank"]), str(row["kind"]), int(row["part"]), int(row["parts"]), bytes(row["data"]))

    def to_arrow(self):
        """This record as a one-row pyarrow RecordBatch of RECORD_SCHEMA's columns."""
        import pyarrow as pa

        types = {"int": pa.int32(), "string": pa.string(), "binary": pa.binary()}
        schema = pa.schema([(name, types[kind]) for name, kind in _RECORD_COLUMNS])
        return pa.RecordBatch.from_arrays([pa.array([getattr(self, name)], types[kind])
                                           for name, kind in _RECORD_COLUMNS], schema=schema)
