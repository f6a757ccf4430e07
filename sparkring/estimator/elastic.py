"""Elastic fit: the plan that makes training independent of the world size (global batches of
batchSize x numProc rows, each rank's gradient weighted by its share), checkpoints inside an
epoch, and the driver's loop that launches again, with the slots the cluster has, when a rank
or an executor is lost."""
from __future__ import annotations

import dataclasses
import logging
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
    restarts: int = 0

    def share(self, rank: int, size: int) -> int:
        """Rows of each global batch that ``rank`` of ``size`` ranks trains on."""
        g = self.global_batch
        return (rank + 1) * g // size - rank * g // size

    def gradient_weight(self, rank: int, size: int) -> float:
        """What this rank's mean loss is multiplied by so that the average over ``size`` ranks
        (DistributedOptimizer's) is the mean over the whole global batch."""
        return self.share(rank, size) * size / self.global_batch


def fit_with_restarts(spark, launch_plan: LaunchPlan, elastic: ElasticPlan, max_restarts: int, start_timeout: float,
                      launch_once: Callable[[LaunchPlan, ElasticPlan], List[Any]],
                      replan: Callable[[int], LaunchPlan], say: Callable[[str], None],
                      final: Callable[[BaseException], bool] = lambda exc: False) -> List[Any]:
    """Launch; when ranks are lost (a rank failed or did not start, an executor was lost), launch
    again from the last checkpoint with ``min(numProc, the slots the cluster offers within
    start_timeout)`` ranks, at most ``max_restarts`` times; fewer slots than ``min_size``:
    RankTimeoutError. A failure ``final`` says another launch cannot mend is raised at once."""
    restarts = 0
    while True:
        try:
            return launch_once(launch_plan, dataclasses.replace(elastic, restarts=restarts))
        except (RankFailedError, RankTimeoutError, StageLostError) as exc:
            if restarts >= max_restarts or final(exc):
                raise
            size = _slots_within(spark, elastic.target_size, start_timeout)
            if size < elastic.min_size:
                raise RankTimeoutError(
                    f"the fit lost ranks ({_first_line(exc)}) and the cluster offers {size} task slot(s) within "
                    f"startTimeout={start_timeout:g}s, fewer than minProc={elastic.min_size}: add executors, or "
                    "lower minProc", list(range(size, elastic.target_size))) from exc
            restarts += 1
            say(f"lost ranks ({_first_line(exc)}): going on with {size} of {elastic.target_size} ranks from the "
                f"last checkpoint (restart {restarts} of at most {max_restarts})")
            launch_plan = replan(size)


def _slots_within(spark, wanted: int, timeout: float) -> int:
    """The slots the cluster offers: ``wanted`` as soon as it does, else what it has after ``timeout``."""
    wait_for_slots(spark, wanted, timeout)
    slots = registered_slots(spark)
    return wanted if slots is None else min(slots, wanted)  # None: no way to ask, the launch finds out


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
