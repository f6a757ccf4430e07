"""The driver's elastic loop, shared by run(min_proc=...) and an elastic fit(): launch; when
ranks are lost, launch again at once from the last checkpoint or commit with the slots the cluster
offers (at least min_proc); while fewer ranks than wanted run, watch for the slots to come back
and for executors being decommissioned, and ask the ranks to stop (``StopRequest``) so the next
launch has the ranks there are.

The loop asks an ``ElasticPolicy`` (Ray Train v2's scaling and failure policies are the model)
what each launch's end means, and gets a decision back: done, or ``Relaunch``."""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Optional, Union

from ...collective.elastic import Relaunches, StopAsk, StopRequest
from ...errors import RankFailedError, RankTimeoutError, StageLostError
from .plan import LaunchPlan
from .session import (
    decommissioning_executors,
    executor_ids,
    registered_slots,
    request_executors,
    wait_for_slots,
)

log = logging.getLogger(__name__)


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
    ranks_per_task: int = 1         # a task slot runs this many ranks; sizes are multiples of it
    ranks_per_replica: int = 1      # ranks that hold one model together (tensor x pipeline parallel): never split

    def ranks_in(self, slots: int) -> int:
        """The ranks ``slots`` task slots run, at most the target, in whole tasks and whole replicas.

        >>> ElasticLaunch(8, 4, 3, 60, ranks_per_replica=4).ranks_in(7)
        4
        """
        whole = math.lcm(self.ranks_per_task, self.ranks_per_replica)
        return min(slots * self.ranks_per_task, self.target_size) // whole * whole


class _ClusterWatcher:
    """While a launch runs: asks its ranks to stop (``LEAVE``) when an executor is decommissioned,
    or (``GROW``) when there are fewer ranks than wanted and the cluster registers ``wanted``
    task slots again (the running ranks' included)."""

    def __init__(self, spark, running: int, how: ElasticLaunch, request: StopRequest, say: Callable[[str], None],
                 every: float = 1.0):
        self.spark, self.running, self.request, self.say = spark, running, request, say
        self.how, self.wanted = how, how.target_size
        self.every = every
        # executors decommissioned before this launch run none of its ranks (the scheduler offers them no task)
        self.leaving_before = set(decommissioning_executors(spark) or ())
        self.asked = StopAsk.NOTHING
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="sparkring-cluster-watcher", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(self.every):
            leaving = sorted(set(decommissioning_executors(self.spark) or ()) - self.leaving_before)
            if leaving:
                self.asked = StopAsk.LEAVE
                self.request.make(StopAsk.LEAVE)
                self.say(f"executor {', '.join(leaving)} is decommissioning: the ranks checkpoint and stop, "
                         "and go on without it")
                return
            slots = registered_slots(self.spark)
            if self.running < self.wanted and slots is not None and self.how.ranks_in(slots) >= self.wanted:
                self.asked = StopAsk.GROW
                self.request.make(StopAsk.GROW)
                self.say(f"{slots} task slots again: the ranks stop at their next checkpoint and go on "
                         f"with {self.wanted}")
                return

    def stop(self) -> StopAsk:
        """What the watcher asked of the ranks."""
        self.done.set()
        self.thread.join()
        return self.asked


@dataclass(frozen=True)
class Relaunch:
    """A decision: launch again, because of ``cause``, with these counts; ``wait`` for the slots
    (after a loss) or not (after a decommission: that executor is not coming back)."""

    cause: str
    counts: Relaunches
    wait: bool = True
    note: str = ""  # what the console line adds, e.g. " (restart 1 of at most 3)"
    lost: Optional[BaseException] = None


@dataclass(frozen=True)
class Done:
    """A decision: the launch's results are the run's."""

    results: List[Any]


class ElasticPolicy:
    """What an elastic run does after each launch. A caller (run()'s elastic mode, an elastic
    fit) says how to launch, replan and tell its paused results; the decisions are made here.

    >>> relaunch_until_done(spark, plan, MyPolicy(ElasticLaunch(3, 2, 3, 120)), request)  # doctest: +SKIP
    """

    def __init__(self, how: ElasticLaunch):
        self.how = how

    def launch(self, launch_plan: LaunchPlan, counts: Relaunches) -> List[Any]:
        """One launch with ``launch_plan``'s ranks (``counts``: what the run did so far)."""
        raise NotImplementedError

    def replan(self, size: int) -> LaunchPlan:
        """The plan of the next launch, with ``size`` ranks."""
        raise NotImplementedError

    def is_paused(self, results: List[Any]) -> bool:
        """The ranks stopped because the driver asked them to (the run goes on)."""
        raise NotImplementedError

    def is_final(self, exc: BaseException) -> bool:
        """A failure another launch cannot mend (raised at once)."""
        return False

    def resume_point(self) -> str:
        """Where the next launch starts, in the console's words."""
        return "the last checkpoint"

    def say(self, message: str) -> None:
        """Tell the user what the run does now."""
        log.info("%s", message)

    def after_results(self, results: List[Any], asked: StopAsk, counts: Relaunches) -> Union[Done, Relaunch]:
        """What follows the ranks' results: done, or a relaunch where they paused to change size."""
        if not self.is_paused(results):
            return Done(results)
        if asked == StopAsk.LEAVE:
            return Relaunch("an executor left", replace(counts, decommissions=counts.decommissions + 1), wait=False)
        return Relaunch("the slots are back", replace(counts, grows=counts.grows + 1))

    def after_failure(self, exc: BaseException, counts: Relaunches) -> Relaunch:
        """Launch again after a loss, or raise ``exc`` (out of restarts, or final)."""
        if counts.restarts >= self.how.max_restarts or self.is_final(exc):
            raise exc
        counts = replace(counts, restarts=counts.restarts + 1)
        return Relaunch(what_was_lost(exc), counts, note=f" (restart {counts.restarts} of at most "
                        f"{self.how.max_restarts})", lost=exc)


def relaunch_until_done(spark, launch_plan: LaunchPlan, policy: ElasticPolicy, request: StopRequest) -> List[Any]:
    """Launch; when ranks are lost (a rank failed or did not start, an executor was lost), launch
    again at once with ``min(target, the slots the cluster offers)`` ranks, as the policy decides
    (waiting up to start_timeout only while fewer than ``min_size`` are there: then RankTimeoutError).
    Ranks the driver asked to
    stop end paused: the run goes on with more ranks (the slots came back), or at once with the
    slots left (an executor decommissioned). The console line says where the next launch starts
    ("lost rank 2 (executor 10.0.0.7:41113): going on with 2 of 3 ranks from step 138 of epoch 2").

    >>> relaunch_until_done(spark, plan, policy, request)  # doctest: +SKIP
    """
    counts, how = Relaunches(), policy.how
    if launch_plan.gang:
        size = _autoscaled_size(spark, launch_plan, how, policy.say)
        launch_plan = launch_plan if size == launch_plan.num_proc else policy.replan(size)
    try:
        while True:
            if request.read():
                request.clear()  # an earlier run's, or the launch that ended on it
            watcher = _ClusterWatcher(spark, launch_plan.num_proc, how, request, policy.say)
            decision: Union[Done, Relaunch]
            try:
                results = policy.launch(launch_plan, counts)
                decision = policy.after_results(results, watcher.stop(), counts)
            except (RankFailedError, RankTimeoutError, StageLostError) as exc:
                watcher.stop()
                decision = policy.after_failure(exc, counts)
            if isinstance(decision, Done):
                return decision.results
            counts = decision.counts
            size = _size_for_next_launch(spark, how, decision.cause, decision.lost, wait=decision.wait)
            launch_plan = policy.replan(size)
            policy.say(f"{decision.cause}: going on with {launch_plan.num_proc} of {how.target_size} ranks from "
                       f"{policy.resume_point()}{decision.note}")
    finally:
        if request.read():
            request.clear()


def _autoscaled_size(spark, launch_plan: LaunchPlan, how: ElasticLaunch, say: Callable[[str], None]) -> int:
    """Under dynamic allocation, before the first launch: ask for the executors the target needs
    (as many as the bound allows), wait up to start_timeout for them, and start with what came (at
    least min_size); the watcher grows the run as more register."""
    facts = launch_plan.facts
    wanted = how.target_size // how.ranks_per_task
    bound, why = facts.autoscaling_bound()
    reachable = wanted if bound is None else min(wanted, bound)
    per_executor = max(1, (facts.executor_cores or facts.task_cpus) // facts.task_cpus)
    request_executors(spark, -(-reachable // per_executor))
    slots = _slots_granted(spark, reachable, per_executor, how.start_timeout)
    size = how.target_size if slots is None else how.ranks_in(slots)
    if size < how.min_size:
        raise RankTimeoutError(
            f"dynamic allocation gave {size} rank(s) within {how.start_timeout_name}={how.start_timeout:g}s, fewer "
            f"than {how.min_size_name}={how.min_size} ({why}): raise the executors' limit or lower "
            f"{how.min_size_name}", list(range(size, how.target_size)))
    if size < how.target_size:
        say(f"dynamic allocation gave {slots} task slot(s) of the {wanted} wanted ({why}): going on with {size} "
            f"of {how.target_size} ranks; the run grows when more executors register")
    return size


def _slots_granted(spark, wanted: int, per_executor: int, timeout: float) -> Optional[int]:
    """The task slots of every executor that registered while waiting up to ``timeout`` for
    ``wanted`` of them: one granted may go idle and be released again before the ranks' tasks are
    pending (they then ask for it back), so executors are counted as they come, not as they stay."""
    deadline, seen = time.monotonic() + timeout, set()
    while True:
        ids = executor_ids(spark)
        if ids is None:
            return registered_slots(spark)
        seen.update(ids)
        if len(seen) * per_executor >= wanted or time.monotonic() > deadline:
            return len(seen) * per_executor
        time.sleep(0.25)


def _size_for_next_launch(spark, how: ElasticLaunch, cause: str, lost: Optional[BaseException], wait: bool) -> int:
    """The slots the cluster offers now, at most the target: a loss for good costs no wait (the
    watcher grows the run back when the slots return, as for a start with fewer); only fewer than
    min_size waits, up to start_timeout (not at all after a decommission: that executor is not
    coming back), then raises RankTimeoutError."""
    wait_for_slots(spark, -(-how.min_size // how.ranks_per_task), how.start_timeout if wait else 0.0)
    slots = registered_slots(spark)
    size = how.target_size if slots is None else how.ranks_in(slots)  # None: the launch finds out
    if size < how.min_size:
        raise RankTimeoutError(
            f"{cause}; the cluster offers {size} rank(s) within {how.start_timeout_name}="
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
