"""The barrier stage of one launch, collected on a thread of its own, and what it ended with."""
from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import cloudpickle

from ...errors import SparkRingError
from ..protocol import MESSAGE, RECORD_SCHEMA, RESULT, OutputRecord, TaskSpec
from ..task.barrier import stage_function
from .plan import LaunchPlan
from .session import JobTag

log = logging.getLogger(__name__)
# How a cancelled job reads: Spark 4's error class, Spark 3.5's "Job 12 cancelled part of ..."
_CANCELLED = re.compile(r"SPARK_JOB_CANCELLED|Job \d+ cancelled")
# How Spark refuses a barrier stage larger than the slots it has (read here only, into StageOutcome)
_SLOTS_CHECK = "BarrierJobSlotsNumberCheckFailed"


@dataclass(frozen=True)
class StageOutcome:
    """How the stage ended: its output records, or the error Spark raised (and what kind of error)."""

    records: List[OutputRecord] = field(default_factory=list)
    error: Optional[BaseException] = None
    slots_refused: bool = False  # Spark refused the barrier stage for lack of slots until start_timeout
    cancelled: bool = False  # the job was cancelled (cancelAllJobs, a tag, the UI)

    def messages(self) -> List[OutputRecord]:
        """The ranks' message records, by rank."""
        return sorted((r for r in self.records if r.kind == MESSAGE), key=lambda r: r.rank)

    def results(self, num_proc: int) -> List[Any]:
        """The ranks' return values, reassembled from their chunks, by rank."""
        parts: Dict[int, Dict[int, bytes]] = {}
        totals: Dict[int, int] = {}
        for record in self.records:
            if record.kind == RESULT:
                parts.setdefault(record.rank, {})[record.part] = record.data
                totals[record.rank] = record.parts
        results = []
        for rank in range(num_proc):
            got = parts.get(rank, {})
            if len(got) != totals.get(rank, -1):
                raise SparkRingError(f"rank {rank}'s result came back incomplete "
                                     f"({len(got)} of {totals.get(rank)} chunks)")
            data = b"".join(got[i] for i in range(len(got)))
            if data:
                log.info("rank %d's result: %d bytes", rank, len(data))
            results.append(cloudpickle.loads(data))
        return results


class Stage:
    """The barrier stage, collected on a thread of its own; the launch is retried while Spark
    refuses it for lack of slots (executors still registering) within start_timeout."""

    def __init__(self, spark, spec: TaskSpec, launch_plan: LaunchPlan, tag: JobTag, start_timeout: float):
        self.spark, self.spec, self.plan, self.tag, self.start_timeout = spark, spec, launch_plan, tag, start_timeout
        self.outcome = StageOutcome()
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._collect, name="sparkring-collect", daemon=True)

    def _frame(self):
        tasks = self.plan.num_tasks
        # the profile keyword only where there is one: Spark 3.5's mapInArrow has none
        profile = {"profile": self.plan.profile} if self.plan.profile is not None else {}
        df = self.spark.range(0, tasks, 1, tasks).mapInArrow(stage_function(self.spec), RECORD_SCHEMA,
                                                             barrier=not self.plan.gang, **profile)
        if self.plan.attempts > 1:
            # Spark never retries a failed barrier *result* stage, only a barrier map stage: a
            # shuffle after the ranks lets it rerun them.
            df = df.repartition(1)
        return df

    def _collect(self) -> None:
        while True:
            try:
                with self.tag:
                    rows = self._frame().collect()
                self.outcome = StageOutcome(records=[OutputRecord.from_row(r) for r in rows])
                return
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                # Spark refuses a barrier stage larger than the slots it has *now*; with adaptive
                # execution (a map stage submitted alone) it does not wait for executors that are
                # still registering, so the launch is retried until start_timeout.
                refused = _SLOTS_CHECK in str(exc)
                if refused and time.monotonic() - self.started < self.start_timeout:
                    log.info("barrier stage refused for lack of slots; retrying while executors register")
                    time.sleep(1.0)
                    continue
                self.outcome = StageOutcome(error=exc, slots_refused=refused,
                                            cancelled=bool(_CANCELLED.search(str(exc))))
                return

    def start(self) -> None:
        """Start the stage's Spark job on its own thread."""
        self.started = time.monotonic()
        self.thread.start()

    def running(self) -> bool:
        """Whether the job still runs (waits up to 0.1 s for it to end)."""
        self.thread.join(0.1)
        return self.thread.is_alive()

    def cancel(self) -> None:
        """Cancel the job and wait up to 30 s for its thread."""
        self.tag.cancel()
        self.thread.join(30)
