"""Elastic fit: the plan that makes training independent of the world size (global batches of
batchSize x numProc rows, each rank's gradient weighted by its share), checkpoints inside an
epoch, and the driver's loop that launches again, with the slots the cluster has, when a rank
or an executor is lost, and with numProc ranks again when the slots come back.

The driver asks the ranks to stop at their next checkpoint through a file beside the run's
checkpoints (``GrowRequest``) rather than the runner's channel: every rank already reaches the
store, and a run whose driver cannot be reached (Spark Connect's detached runs) reads it alike."""
from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from ..errors import RankFailedError, RankTimeoutError, StageLostError
from ..runner import LaunchPlan
from ..runner.driver.session import registered_slots, wait_for_slots

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ElasticPlan:
    """How an elastic fit runs: ``global_batch`` rows per step whatever the number of ranks,
    a checkpoint every ``checkpoint_every`` steps, down to ``min_size`` ranks.

    >>> ElasticPlan(global_batch=48, target_size=3, min_size=2).share(rank=0, size=2)
    24
    """

    global_batch: int
    target_size: int
    min_size: int
    checkpoint_every: Optional[int] = None
    restarts: int = 0  # launches after a loss so far
    grows: int = 0  # launches that brought the ranks back to target_size so far

    def share(self, rank: int, size: int) -> int:
        """Rows of each global batch that ``rank`` of ``size`` ranks trains on."""
        g = self.global_batch
        return (rank + 1) * g // size - rank * g // size

    def gradient_weight(self, rank: int, size: int) -> float:
        """What this rank's mean loss is multiplied by so that the average over ``size`` ranks
        (DistributedOptimizer's) is the mean over the whole global batch."""
        return self.share(rank, size) * size / self.global_batch


@dataclass(frozen=True)
class GrowRequest:
    """The driver's request that the ranks stop at their next checkpoint, so that the fit goes
    on with more of them: a file beside the run's checkpoints.

    >>> from sparkring import Store
    >>> import tempfile
    >>> request = GrowRequest(Store(tempfile.mkdtemp()), "run")
    >>> request.make(3); request.made()
    True
    """

    store: Any
    run_id: str

    def _path(self) -> str:
        return self.store.checkpoint_path(self.run_id, "grow-request")

    def make(self, size: int) -> None:
        self.store.write_bytes(self._path(), str(size).encode())

    def made(self) -> bool:
        return self.store.exists(self._path())

    def clear(self) -> None:
        self.store.delete(self._path())


class _SlotWatcher:
    """While a launch runs with fewer ranks than wanted: makes the grow request once the cluster
    registers ``wanted`` task slots (the running ranks' included)."""

    def __init__(self, spark, wanted: int, request: GrowRequest, say: Callable[[str], None], every: float = 1.0):
        self.spark, self.wanted, self.request, self.say, self.every = spark, wanted, request, say, every
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="sparkring-slot-watcher", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(self.every):
            slots = registered_slots(self.spark)
            if slots is not None and slots >= self.wanted:
                self.request.make(self.wanted)
                self.say(f"{slots} task slots again: the ranks stop at their next checkpoint and the fit goes on "
                         f"with {self.wanted}")
                return

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def fit_with_restarts(spark, launch_plan: LaunchPlan, elastic: ElasticPlan, max_restarts: int, start_timeout: float,
                      launch_once: Callable[[LaunchPlan, ElasticPlan], List[Any]],
                      replan: Callable[[int], LaunchPlan], say: Callable[[str], None], request: GrowRequest,
                      paused: Callable[[List[Any]], bool], final: Callable[[BaseException], bool] = lambda exc: False
                      ) -> List[Any]:
    """Launch; when ranks are lost (a rank failed or did not start, an executor was lost), launch
    again from the last checkpoint with ``min(numProc, the slots the cluster offers within
    start_timeout)`` ranks, at most ``max_restarts`` times; fewer slots than ``min_size``:
    RankTimeoutError. A failure ``final`` says another launch cannot mend is raised at once.
    A launch with fewer ranks than wanted is asked to stop at its next checkpoint once the slots
    are back (its results are then ``paused``) and the fit goes on with more ranks."""
    restarts = grows = 0
    try:
        while True:
            if request.made():
                request.clear()  # an earlier fit's, or the launch that ended on it
            watcher = (_SlotWatcher(spark, elastic.target_size, request, say)
                       if launch_plan.num_proc < elastic.target_size else None)
            try:
                results = launch_once(launch_plan, dataclasses.replace(elastic, restarts=restarts, grows=grows))
                if not paused(results):
                    return results
                grows += 1
                cause, lost, counted = "the slots are back", None, ""
            except (RankFailedError, RankTimeoutError, StageLostError) as exc:
                if restarts >= max_restarts or final(exc):
                    raise
                restarts += 1
                cause, lost = f"lost ranks ({_first_line(exc)})", exc
                counted = f" (restart {restarts} of at most {max_restarts})"
            finally:
                if watcher is not None:
                    watcher.stop()
            size = _slots_within(spark, elastic.target_size, start_timeout)
            if size < elastic.min_size:
                raise RankTimeoutError(
                    f"{cause}; the cluster offers {size} task slot(s) within startTimeout={start_timeout:g}s, "
                    f"fewer than minProc={elastic.min_size}: add executors, or lower minProc",
                    list(range(size, elastic.target_size))) from lost
            say(f"{cause}: going on with {size} of {elastic.target_size} ranks from the last checkpoint{counted}")
            launch_plan = replan(size)
    finally:
        if request.made():
            request.clear()


def _slots_within(spark, wanted: int, timeout: float) -> int:
    """The slots the cluster offers: ``wanted`` as soon as it does, else what it has after ``timeout``."""
    wait_for_slots(spark, wanted, timeout)
    slots = registered_slots(spark)
    return wanted if slots is None else min(slots, wanted)  # None: no way to ask, the launch finds out


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
