"""The driver's elastic loop, shared by run(min_proc=...) and an elastic fit(): launch; when
ranks are lost, launch again from the last checkpoint or commit with the slots the cluster
offers (at least min_proc); while fewer ranks than wanted run, watch for the slots to come back
and for executors being decommissioned, and ask the ranks to stop (``StopRequest``) so the next
launch has the ranks there are."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Optional

from ...collective.elastic import GROW, LEAVE, StopRequest
from ...errors import RankFailedError, RankTimeoutError, StageLostError
from .plan import LaunchPlan
from .session import decommissioning_executors, registered_slots, wait_for_slots

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Relaunches:
    """What an elastic run did so far: launches after a loss, launches that brought the ranks
    back to the target, launches after an executor was decommissioned.

    >>> Relaunches(restarts=1).restarts
    1
    """

    restarts: int = 0
    grows: int = 0
    decommissions: int = 0


@dataclass(frozen=True)
class ElasticLaunch:
    """How the loop relaunches: down to ``min_size`` of ``target_size`` ranks, at most
    ``max_restarts`` launches after a loss, each waiting up to ``start_timeout`` for the slots;
    ``start_timeout_name`` is what the user calls that setting (errors name it).

    >>> ElasticLaunch(target_size=3, min_size=2, max_restarts=3, start_timeout=120).min_size
    2
    """

    target_size: int
    min_size: int
    max_restarts: int
    start_timeout: float
    start_timeout_name: str = "start_timeout"
    min_size_name: str = "min_proc"


class _ClusterWatcher:
    """While a launch runs: asks its ranks to stop (``LEAVE``) when an executor is decommissioned,
    or (``GROW``) when there are fewer ranks than wanted and the cluster registers ``wanted``
    task slots again (the running ranks' included)."""

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
                self.say(f"executor {', '.join(leaving)} is decommissioning: the ranks checkpoint and stop, "
                         "and go on without it")
                return
            slots = registered_slots(self.spark)
            if self.running < self.wanted and slots is not None and slots >= self.wanted:
                self.asked = GROW
                self.request.make(GROW)
                self.say(f"{slots} task slots again: the ranks stop at their next checkpoint and go on "
                         f"with {self.wanted}")
                return

    def stop(self) -> int:
        """What the watcher asked of the ranks (0, GROW or LEAVE)."""
        self.done.set()
        self.thread.join()
        return self.asked


def relaunch_until_done(spark, launch_plan: LaunchPlan, how: ElasticLaunch,
                        launch_once: Callable[[LaunchPlan, Relaunches], List[Any]],
                        replan: Callable[[int], LaunchPlan], say: Callable[[str], None], request: StopRequest,
                        paused: Callable[[List[Any]], bool],
                        final: Callable[[BaseException], bool] = lambda exc: False,
                        resume_point: Callable[[], str] = lambda: "the last checkpoint") -> List[Any]:
    """Launch; when ranks are lost (a rank failed or did not start, an executor was lost), launch
    again with ``min(target, the slots the cluster offers within start_timeout)`` ranks, at most
    ``max_restarts`` times; fewer slots than ``min_size``: RankTimeoutError. A failure ``final``
    says another launch cannot mend is raised at once. Ranks the driver asked to stop end
    ``paused``: the run goes on with more ranks (the slots came back), or at once with the slots
    left (an executor decommissioned). ``resume_point`` says where the next launch starts (the
    console line: "lost rank 2 (executor 10.0.0.7:41113): going on with 2 of 3 ranks from step
    138 of epoch 2").

    >>> relaunch_until_done(spark, plan, ElasticLaunch(3, 2, 3, 120), launch_once, replan, print,
    ...                     request, paused=lambda results: False)  # doctest: +SKIP
    """
    counts = Relaunches()
    try:
        while True:
            if request.read():
                request.clear()  # an earlier run's, or the launch that ended on it
            watcher = _ClusterWatcher(spark, launch_plan.num_proc, how.target_size, request, say)
            lost: Optional[BaseException] = None
            try:
                results = launch_once(launch_plan, counts)
                asked = watcher.stop()
                if not paused(results):
                    return results
                left = asked == LEAVE
                counts = replace(counts, decommissions=counts.decommissions + left, grows=counts.grows + (not left))
                cause, counted = ("an executor left" if left else "the slots are back"), ""
            except (RankFailedError, RankTimeoutError, StageLostError) as exc:
                watcher.stop()
                if counts.restarts >= how.max_restarts or final(exc):
                    raise
                counts = replace(counts, restarts=counts.restarts + 1)
                cause, lost, left = what_was_lost(exc), exc, False
                counted = f" (restart {counts.restarts} of at most {how.max_restarts})"
            launch_plan = replan(_size_for_next_launch(spark, how, cause, lost, wait=not left))
            say(f"{cause}: going on with {launch_plan.num_proc} of {how.target_size} ranks from {resume_point()}"
                f"{counted}")
    finally:
        if request.read():
            request.clear()


def _size_for_next_launch(spark, how: ElasticLaunch, cause: str, lost: Optional[BaseException], wait: bool) -> int:
    """The slots the cluster offers within start_timeout (at once after a decommission: that
    executor is not coming back), at most the target; fewer than min_size: RankTimeoutError."""
    wait_for_slots(spark, how.target_size, how.start_timeout if wait else 0.0)
    slots = registered_slots(spark)
    size = how.target_size if slots is None else min(slots, how.target_size)  # None: the launch finds out
    if size < how.min_size:
        raise RankTimeoutError(
            f"{cause}; the cluster offers {size} task slot(s) within {how.start_timeout_name}="
            f"{how.start_timeout:g}s, fewer than {how.min_size_name}={how.min_size}: add executors, or lower "
            f"{how.min_size_name}", list(range(size, how.target_size))) from lost
    return size


def what_was_lost(exc: BaseException) -> str:
    """What a console line says of a loss: the ranks and their executors where the driver knows
    them, with a failed rank's last traceback line; else the message's first line.

    >>> what_was_lost(StageLostError("gone", lost={2: "10.0.0.7:41113"}))
    'lost rank 2 (executor 10.0.0.7:41113)'
    """
    if isinstance(exc, StageLostError) and exc.lost:
        return "lost " + ", ".join(f"rank {rank}" + (f" (executor {where})" if where else "")
                                   for rank, where in exc.lost.items())
    if isinstance(exc, RankFailedError) and exc.remote_traceback.strip():
        last = exc.remote_traceback.strip().splitlines()[-1].strip()
        where = f" (executor {exc.executor})" if exc.executor else ""
        return f"lost rank {exc.rank}{where}: {last}"[:240]
    return f"lost ranks ({(str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]})"
