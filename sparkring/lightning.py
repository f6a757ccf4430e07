"""PyTorch Lightning inside ``sparkring.run()``: a ClusterEnvironment that hands Lightning's own
DDP the rank layout sparkring's runner set up (the torchrun variables every rank gets), so a
user's ``Trainer`` trains across the ranks of a Spark barrier stage.

>>> from sparkring.lightning import SparkRingEnvironment, trainer_layout  # doctest: +SKIP
>>> def train():  # doctest: +SKIP
...     trainer = pl.Trainer(strategy="ddp", accelerator="cpu", plugins=[SparkRingEnvironment()],
...                          **trainer_layout(), max_epochs=2)
...     trainer.fit(module, loader)
>>> sparkring.run(train, num_proc=4)  # doctest: +SKIP
"""
from __future__ import annotations

import logging
import os
from typing import Dict

from typing_extensions import override

from .collective import environment

try:  # the pytorch-lightning package, or the unified lightning package
    from pytorch_lightning.plugins.environments import ClusterEnvironment
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from lightning.pytorch.plugins.environments import ClusterEnvironment  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError("sparkring.lightning needs PyTorch Lightning: pip install 'sparkring[lightning]' "
                          "(pytorch-lightning)") from exc

log = logging.getLogger(__name__)


def _number(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f"{name} is not set: SparkRingEnvironment works inside sparkring.run() (or the "
                           "estimator), whose runner gives every rank its place")
    return int(value)


def trainer_layout() -> Dict[str, int]:
    """``devices`` and ``num_nodes`` for ``Trainer`` as sparkring placed this rank: the ranks on
    this host and the number of hosts (every rank of a host sees the host's GPUs in local-rank
    order, so Lightning's ``devices[local_rank]`` is the rank's own GPU).

    >>> trainer_layout()  # doctest: +SKIP
    {'devices': 2, 'num_nodes': 1}
    """
    return {"devices": _number("LOCAL_WORLD_SIZE"), "num_nodes": _number("GROUP_WORLD_SIZE")}


class SparkRingEnvironment(ClusterEnvironment):
    """Lightning's view of a sparkring rank: processes created by the runner (one per Spark
    task), rank, size, local rank and host from the runner, the address and port rank 0's task
    reserved for ``init_process_group``. Lightning's own guesses of ranks (node_rank x devices +
    local_rank) are ignored: sparkring's layout is the truth, also with uneven hosts.

    >>> Trainer(strategy="ddp", plugins=[SparkRingEnvironment()], **trainer_layout())  # doctest: +SKIP
    """

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return os.environ["MASTER_ADDR"]

    @property
    @override
    def main_port(self) -> int:
        return _number("MASTER_PORT")

    @staticmethod
    def detect() -> bool:
        """True in a rank the sparkring runner started."""
        return environment.RANK in os.environ and "MASTER_PORT" in os.environ

    @override
    def world_size(self) -> int:
        return _number("WORLD_SIZE")

    @override
    def set_world_size(self, size: int) -> None:
        if size != self.world_size():
            log.debug("Lightning computed world size %d; sparkring runs %d ranks", size, self.world_size())

    @override
    def global_rank(self) -> int:
        return _number("RANK")

    @override
    def set_global_rank(self, rank: int) -> None:
        if rank != self.global_rank():
            log.debug("Lightning computed global rank %d; sparkring's rank is %d", rank, self.global_rank())

    @override
    def local_rank(self) -> int:
        return _number("LOCAL_RANK")

    @override
    def node_rank(self) -> int:
        return _number("GROUP_RANK")

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        layout = trainer_layout()
        if (num_devices, num_nodes) != (layout["devices"], layout["num_nodes"]):
            raise ValueError(
                f"Trainer(devices={num_devices}, num_nodes={num_nodes}) does not match how sparkring placed the "
                f"ranks: {layout['devices']} on this host, {layout['num_nodes']} host(s); pass "
                "**sparkring.lightning.trainer_layout() to Trainer")
