"""Several ranks in one barrier task: each rank's view of the task's context (its rank, its share
of the task's GPUs) and the one allGather and barrier per task that its ranks share.

Spark gives a barrier task one context and counts one participant per task in ``allGather`` and
``barrier``; a task that runs k ranks (``ranks_per_task``, one per GPU of an 8-GPU task) has its
k threads meet here first, so the task takes part once with the k messages. Nothing in pyspark
does this (Spark 4.2's TorchDistributor starts torchrun inside the task instead), hence by hand."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

from ...errors import ConfigurationError

STOPPED_MARK = "was stopped"  # how a rank aborted because of another rank's failure says so


@dataclass(frozen=True)
class GpuShare:
    """A rank's GPU addresses, shaped as Spark's ResourceInformation (``.addresses``)."""

    name: str
    addresses: List[str]


class TaskRanks:
    """The ranks of one barrier task: ``view(i)`` is rank i's context; ``run`` runs one function
    per rank on threads of this task and yields what they returned, in rank order.

    >>> ranks = TaskRanks(BarrierTaskContext.get(), 2)  # doctest: +SKIP
    >>> list(ranks.run(lambda ctx: [ctx.partitionId()]))  # doctest: +SKIP
    [2, 3]
    """

    def __init__(self, ctx, per_task: int):
        self.ctx, self.per_task = ctx, per_task
        self._cond = threading.Condition()
        self._posted: Dict[int, Dict[int, Any]] = {}    # round -> local index -> message
        self._answers: Dict[int, Any] = {}
        self._failed: Optional[BaseException] = None

    def view(self, local: int) -> "RankContext":
        """The task's context as its local rank ``local`` sees it."""
        return RankContext(self, local)

    def meet(self, round_: int, local: int, message: Any, together: Callable[[List[Any]], Any]) -> Any:
        """Post ``message`` for this round; the last rank to post runs ``together`` on every
        message (the task's one call into Spark) and every rank gets its answer."""
        with self._cond:
            posted = self._posted.setdefault(round_, {})
            posted[local] = message
            last = len(posted) == self.per_task
        if last:
            try:
                answer = together([posted[i] for i in range(self.per_task)])
            except BaseException as exc:  # noqa: BLE001 - every rank of the task raises it
                self.fail(exc)
                raise
            with self._cond:
                self._answers[round_] = answer
                self._cond.notify_all()
            return answer
        with self._cond:
            while round_ not in self._answers and self._failed is None:
                self._cond.wait(1.0)
            if round_ not in self._answers:
                raise RuntimeError(f"another rank of this task failed before the rendezvous: {self._failed!r}")
            return self._answers[round_]

    def fail(self, exc: BaseException) -> None:
        """Wake every waiting rank of this task with ``exc``."""
        with self._cond:
            self._failed = self._failed or exc
            self._cond.notify_all()

    def run(self, body: Callable[["RankContext"], List[Any]]) -> Iterator[Any]:
        """Run ``body`` once per rank of this task, together; raise the first rank's own error
        (before those of ranks stopped because of it)."""
        outputs: Dict[int, List[Any]] = {}
        errors: Dict[int, BaseException] = {}

        def one(local: int) -> None:
            try:
                outputs[local] = body(self.view(local))
            except BaseException as exc:  # noqa: BLE001 - re-raised below, on the task's thread
                errors[local] = exc
                self.fail(exc)

        threads = [threading.Thread(target=one, args=(i,), name=f"sparkring-rank-{i}", daemon=True)
                   for i in range(self.per_task)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            causes = [e for e in errors.values() if STOPPED_MARK not in str(e)] or list(errors.values())
            raise causes[0]
        for local in range(self.per_task):
            yield from outputs[local]


class GangContext:
    """A task of an ordinary stage (dynamic allocation, where Spark runs no barrier stage) seen
    as a barrier task: the tasks meet through the driver's rendezvous only, each saying where it
    is reached; a task Spark retries alone refuses to run (a lost task is a lost rank)."""

    def __init__(self, ctx):
        self._ctx = ctx
        if ctx.attemptNumber() > 0:
            raise RuntimeError(f"task {ctx.partitionId()} was retried by Spark on its own: a lost rank ends "
                               "this launch (an elastic run launches again with the ranks there are)")

    def partitionId(self) -> int:  # noqa: N802 - BarrierTaskContext's names
        """This task's partition (as BarrierTaskContext's)."""
        return self._ctx.partitionId()

    def taskAttemptId(self) -> int:  # noqa: N802
        """This task's attempt id."""
        return self._ctx.taskAttemptId()

    def stageId(self) -> int:  # noqa: N802
        """The stage's id."""
        return self._ctx.stageId()

    def resources(self) -> Dict[str, Any]:
        """The task's resources (its GPUs)."""
        return self._ctx.resources()

    def getTaskInfos(self) -> List[Any]:  # noqa: N802
        """Refused: an ordinary stage's tasks learn each other's places from the driver."""
        raise RuntimeError("an ordinary stage's tasks learn each other's places from the driver's rendezvous")

    def allGather(self, message: str = "") -> List[str]:  # noqa: N802
        """Refused: without a barrier stage, the ranks meet only through the driver."""
        raise RuntimeError("the ranks could not all reach the driver, and without a barrier stage (dynamic "
                           "allocation) they have no other place to meet: let the executors reach the driver")

    def barrier(self) -> None:
        """Meet the other tasks (an allGather)."""
        self.allGather()


class RankContext:
    """One rank's view of its barrier task, with the calls of BarrierTaskContext the task body
    makes: its rank as ``partitionId``, every rank's task info, its share of the task's GPUs, and
    ``allGather``/``barrier`` over every rank of the stage."""

    def __init__(self, ranks: TaskRanks, local: int):
        self._ranks, self._local = ranks, local
        self._rounds = 0

    def partitionId(self) -> int:  # noqa: N802 - BarrierTaskContext's name
        """This rank's index among all: the task's partition times its ranks, plus the local rank."""
        return self._ranks.ctx.partitionId() * self._ranks.per_task + self._local

    def getTaskInfos(self) -> List[Any]:  # noqa: N802
        """The tasks' infos, one per rank (a task's repeated for each of its ranks)."""
        return [info for info in self._ranks.ctx.getTaskInfos() for _ in range(self._ranks.per_task)]

    def taskAttemptId(self) -> int:  # noqa: N802
        """This task's attempt id."""
        return self._ranks.ctx.taskAttemptId()

    def stageId(self) -> int:  # noqa: N802
        """The stage's id."""
        return self._ranks.ctx.stageId()

    def resources(self) -> Dict[str, Any]:
        """The task's GPUs split evenly between its ranks, in address order."""
        found = dict(self._ranks.ctx.resources())
        gpus = found.get("gpu")
        if gpus is None or not gpus.addresses:
            return found
        addresses, k = list(gpus.addresses), self._ranks.per_task
        if len(addresses) % k:
            raise ConfigurationError(
                f"this task was given {len(addresses)} GPU(s) {addresses} for {k} ranks: set ranks per task to "
                f"a divisor of spark.task.resource.gpu.amount (or of the training stage's ResourceProfile)")
        each = len(addresses) // k
        found["gpu"] = GpuShare("gpu", addresses[self._local * each:(self._local + 1) * each])
        return found

    def allGather(self, message: str = "") -> List[str]:  # noqa: N802
        """Every rank's message, in rank order: the task's ranks take part in Spark's allGather once."""
        def together(messages: List[str]) -> List[str]:
            per_task = self._ranks.ctx.allGather(json.dumps(messages))
            return [m for text in per_task for m in json.loads(text)]

        return self._meet(message, together)

    def barrier(self) -> None:
        """Meet every rank: the task's own first, then the other tasks."""
        self._meet(None, lambda _: self._ranks.ctx.barrier())

    def _meet(self, message: Any, together: Callable[[List[Any]], Any]) -> Any:
        self._rounds += 1
        return self._ranks.meet(self._rounds, self._local, message, together)
