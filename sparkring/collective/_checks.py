"""Checks that every rank passes the same tensors: names, shapes, dtypes."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from . import _runtime


_checked_names: Dict[str, Tuple] = {}


def check_same_shapes(named: List[Tuple[str, torch.Tensor]], what: str) -> None:
    """Raise ValueError naming the rank and tensor when ranks disagree on names, shapes or dtypes.

    >>> sr.check_same_shapes(list(model.named_parameters()), "DistributedOptimizer")  # doctest: +SKIP
    """
    b = _runtime.current()
    if b.size == 1:
        return
    mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
    from .functions import allgather_object

    everyone = allgather_object(mine)
    for r, theirs in enumerate(everyone):
        if theirs == mine or theirs is None:  # None: a rank that join()ed sends nothing
            continue
        mine_d = {n: (s, d) for n, s, d in mine}
        theirs_d = {n: (s, d) for n, s, d in theirs}
        for n in sorted(set(mine_d) | set(theirs_d)):
            if mine_d.get(n) != theirs_d.get(n):
                raise ValueError(
                    f"{what}: tensor {n!r} is {_describe(theirs_d.get(n))} on rank {r} but "
                    f"{_describe(mine_d.get(n))} on rank {b.rank}; every rank must pass the same "
                    "names with the same shapes and dtypes")
        raise ValueError(f"{what}: rank {r} passes tensors in a different order than rank {b.rank}")


def _describe(entry) -> str:
    return "missing" if entry is None else f"shape {entry[0]} {entry[1]}"


def check_name(name: Optional[str], tensor: torch.Tensor, what: str) -> None:
    """First use of a name: every rank must agree on its shape (Horovod checks this too)."""
    if name is None or _runtime.current().size == 1:
        return
    sig = (tuple(tensor.shape), str(tensor.dtype))
    if _checked_names.get(name) == sig:
        return
    check_same_shapes([(name, tensor)], what)
    _checked_names[name] = sig


def forget_names() -> None:
    """A new ring (init after shutdown) checks every name again."""
    _checked_names.clear()
