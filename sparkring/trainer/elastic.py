"""Elastic fit: the plan that makes training independent of the world size (global batches of
batchSize x numProc rows, each rank's gradient weighted by its share) and checkpoints inside an
epoch. The driver's loop that launches again when ranks are lost or come back is the runner's
(``runner/driver/elastic.py``); it asks the ranks to stop through a ``StopRequest`` file beside
the run's checkpoints."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..collective.elastic import Relaunches, StopRequest


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
    relaunches: Relaunches = Relaunches()  # what the run did so far (rank 0 logs it)

    def share(self, rank: int, size: int) -> int:
        """Rows of each global batch that ``rank`` of ``size`` ranks trains on."""
        g = self.global_batch
        return (rank + 1) * g // size - rank * g // size

    def gradient_weight(self, rank: int, size: int) -> float:
        """What this rank's mean loss is multiplied by so that the average over ``size`` ranks
        (DistributedOptimizer's) is the mean over the whole global batch."""
        return self.share(rank, size) * size / self.global_batch


def stop_request(store: Any, run_id: str) -> StopRequest:
    """The elastic fit's ``StopRequest``: a file beside the run's checkpoints (``store`` a Store).

    >>> from sparkring import Store
    >>> stop_request(Store("/tmp/s"), "r1").url
    '/tmp/s/runs/r1/checkpoints/stop-request'
    """
    return StopRequest(store.checkpoint_url(run_id, "stop-request"), store.storage_options)
