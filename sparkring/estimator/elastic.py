"""Elastic fit: the plan that makes training independent of the world size (global batches of
batchSize x numProc rows, each rank's gradient weighted by its share), checkpoints inside an
epoch, and the driver's loop that launches again, with the slots the cluster has, when a rank
or an executor is lost or decommissioned, and with numProc ranks again when the slots come back.

The driver asks the ranks to stop (at their next checkpoint to grow, at once with a checkpoint
when an executor is decommissioned) through a file beside the run's checkpoints
(``StopRequest``) rather than the runner's channel: every rank already reaches the store, and a
run whose driver cannot be reached (Spark Connect's detached runs) reads it alike."""
from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from ..errors import RankFailedError, RankTimeoutError, StageLostError
from ..runner import LaunchPlan
from ..runner.driver.session import decommissioning_executors, registered_slots, wait_for_slots

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
    decommissions: int = 0  # launches after ranks stopped for a decommissioned executor so far

    def share(self, rank: int, size: int) -> int:
        """Rows of each global batch that ``rank`` of ``size`` ranks trains on."""
        g = self.global_batch
        return (rank + 1) * g // size - rank * g // size

    def gradient_weight(self, rank: int, size: int) -> float:
        """What this rank's mean loss is multiplied by so that the average over ``size`` ranks
        (DistributedOptimizer's) is the mean over the whole global batch."""
        return self.share(rank, size) * size / self.global_batch


GROW, LEAVE = 1, 2  # StopRequest.read(): stop at the next checkpoint; checkpoint at the next step and stop


@dataclass(frozen=True)
class StopRequest:
    """The driver's request that the ranks stop: at their next checkpoint (``GROW``: more ranks
    can train) or with a checkpoint at their next step (``LEAVE``: an executor is going away). A
    file beside the run's checkpoints.

    >>> from sparkring import Store
    >>> import tempfile
    >>> request = StopRequest(Store(tempfile.mkdtemp()), "run")
    >>> request.make(LEAVE); request.read() == LEAVE
    True
    """

    store: Any
    run_id: str

    def _path(self) -> str:
        return self.store.checkpoint_path(self.run_id, "stop-request")

    def make(self, what: int) -> None:
        self.store.write_bytes(self._path(), str(what).encode())

    def read(self) -> int:
        """0 where nothing is asked, else GROW or LEAVE."""
        try:
            return int(self.store.read_bytes(self._path()))
        except (FileNotFoundError, OSError, ValueError):
            return 0

    def clear(self) -> None:
        self.store.delete(self._path())


class _ClusterWatcher:
    """While a launch runs: asks its ranks to stop at once (with a checkpoint) when an executor
    is decommissioned, or at their next checkpoint when there are fewer ranks than wanted and
    the cluster registers ``wanted`` task slots again (the running ranks' included)."""

    def __init__(self, spark, running: int, wanted: int, request: StopRequest, say: Callable[[str], None],
                 every: float = 1.0):
        self.spark, self.running, self.wanted, self.request, self.say = spark, running, wanted, request, say
        self.every = every
        # executors decommissioned before this launch run none of its ranks (the scheduler offers them no task)
        self.leaving_before = set(decommissioning_executors(spark) or ())
        self.asked = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="sparkring-cluster-watcher", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(self.every):
            leaving = sorted(set(decommissioning_executors(self.spark) or ()) - self.leaving_before)
            if leaving:
                self.asked = LEAVE
                self.request.make(LEAVE)
                self.say(f"executor {', '.join(leaving)} is decommissioning: the ranks checkpoint at their next step "
                         "and the fit goes on without it")
                return
            slots = registered_slots(self.spark)
            if self.running < self.wanted and slots is not None and slots >= self.wanted:
                self.asked = GROW
                self.request.make(GROW)
                self.say(f"{slots} task slots again: the ranks stop at their next checkpoint and the fit goes on "
                         f"with {self.wanted}")
                return

    def stop(self) -> int:
        """What the watcher asked of the ranks (0, GROW or LEAVE)."""
        self.done.set()
        self.thread.join()
        return self.asked


def fit_with_restarts(spark, launch_plan: LaunchPlan, elastic: ElasticPlan, max_restarts: int, start_timeout: float,
                      launch_once: Callable[[LaunchPlan, ElasticPlan], List[Any]],
                      replan: Callable[[int], LaunchPlan], say: Callable[[str], None], request: StopRequest,
                      paused: Callable[[List[Any]], bool], final: Callable[[BaseException], bool] = lambda exc: False
                      ) -> List[Any]:
    """Launch; when ranks are lost (a rank failed or did not start, an executor was lost), launch
    again from the last checkpoint with ``min(numProc, the slots the cluster offers within
    start_timeout)`` ranks, at most ``max_restarts`` times; fewer slots than ``min_size``:
    RankTimeoutError. A failure ``final`` says another launch cannot mend is raised at once.
    Ranks the driver asked to stop (``_ClusterWatcher``) end ``paused``: the fit goes on with
    more ranks (the slots came back), or at once with the slots left (an executor decommissioned)."""
    counts = {"restarts": 0, "grows": 0, "decommissions": 0}
    try:
        while True:
            if request.read():
                request.clear()  # an earlier fit's, or the launch that ended on it
            watcher = _ClusterWatcher(spark, launch_plan.num_proc, elastic.target_size, request, say)
            lost: Optional[BaseException] = None
            try:
                results = launch_once(launch_plan, dataclasses.replace(elastic, **counts))
                asked = watcher.stop()
                if not paused(results):
                    return results
                left = asked == LEAVE
                counts["decommissions" if left else "grows"] += 1
                cause, counted = ("an executor left" if left else "the slots are back"), ""
            except (RankFailedError, RankTimeoutError, StageLostError) as exc:
                watcher.stop()
                if counts["restarts"] >= max_restarts or final(exc):
                    raise
                counts["restarts"] += 1
                cause, lost, left = f"lost ranks ({_first_line(exc)})", exc, False
                counted = f" (restart {counts['restarts']} of at most {max_restarts})"
            # a decommissioned executor is not coming back: go on with the slots there are now
            size = _slots_within(spark, elastic.target_size, 0.0 if left else start_timeout)
            if size < elastic.min_size:
                raise RankTimeoutError(
                    f"{cause}; the cluster offers {size} task slot(s) within startTimeout={start_timeout:g}s, "
                    f"fewer than minProc={elastic.min_size}: add executors, or lower minProc",
                    list(range(size, elastic.target_size))) from lost
            say(f"{cause}: going on with {size} of {elastic.target_size} ranks from the last checkpoint{counted}")
            launch_plan = replan(size)
    finally:
        if request.read():
            request.clear()


def _slots_within(spark, wanted: int, timeout: float) -> int:
    """The slots the cluster offers: ``wanted`` as soon as it does, else what it has after ``timeout``."""
    wait_for_slots(spark, wanted, timeout)
    slots = registered_slots(spark)
    return wanted if slots is None else min(slots, wanted)  # None: no way to ask, the launch finds out


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
