"""The batches a rank trains and validates on, from the fit's Dataset: a fixed number of steps per
epoch (more passes where one pass has fewer), pinned ahead for a GPU."""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Iterator

import torch

from sparkring.data.reader import prefetched

from .config import TrainConfig


def run_batches(cfg: TrainConfig, split: str, *, batch_size: int, rank: int, size: int, epoch: int, steps: int,
                shuffle: bool, drop_last: bool, workers: int, device: torch.device):
    """``steps`` batches of ``split`` ("train" or "val") for data-parallel ``rank`` of ``size``,
    starting more passes over the data when one pass has fewer (pinned ahead when they go to a GPU).

    >>> run_batches(cfg, "val", batch_size=64, rank=0, size=2, epoch=0, steps=4, shuffle=False,  # doctest: +SKIP
    ...             drop_last=False, workers=0, device=torch.device("cpu"))
    """
    batches = _passes(cfg, split, bs=batch_size, rank=rank, size=size, epoch=epoch, steps=steps, drop_last=drop_last,
                      shuffle=shuffle, workers=workers)
    return pinned(batches) if device.type == "cuda" else batches


def _passes(cfg: TrainConfig, split: str, *, bs: int, rank: int, size: int, epoch: int, steps: int, drop_last: bool,
            shuffle: bool, workers: int) -> Iterator[Dict[str, Any]]:
    produced = 0
    for extra_pass in itertools.count():
        got = 0
        for batch in cfg.dataset.batches(bs, rank=rank, size=size, shuffle=shuffle, seed=cfg.seed,
                                         epoch=epoch + extra_pass * 100_003, drop_last=drop_last, split=split,
                                         transform=cfg.transform_fn, workers=workers, reader=cfg.reader):
            yield batch
            got += 1
            produced += 1
            if produced >= steps:
                return
        if got == 0 or not drop_last:
            return


def pinned(batches: Iterator[Dict[str, Any]], pin: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.pin_memory,
           depth: int = 2) -> Iterator[Dict[str, Any]]:
    """``batches`` with their tensors copied to page-locked memory on a thread, ``depth``
    batches ahead: a copy from pinned memory to the GPU runs asynchronously (non_blocking),
    from ordinary memory it does not. Stopping early stops the thread.

    >>> next(pinned(iter([{"x": torch.ones(2)}]), pin=torch.Tensor.clone))["x"]
    tensor([1., 1.])
    """
    return prefetched(({k: pin(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                       for batch in batches), depth)
