"""Activation checkpointing of a model's blocks (the activationCheckpointing Param): "full" recomputes
every block's activations in backward instead of keeping them, "selective" every other block.
torch's checkpoint wrapper does the work (non-reentrant; its state_dict hooks keep the keys plain)."""
from __future__ import annotations

import functools
from typing import List, Tuple

import torch

MODES = ("none", "full", "selective")


def blocks(model: torch.nn.Module, wrap: Tuple[str, ...]) -> List[torch.nn.Module]:
    """The model's blocks in forward order: the modules whose class is named in ``wrap``, else every
    child (and every layer of a top-level ModuleList/Sequential) that holds parameters.

    >>> len(blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1)), ()))
    2
    """
    if wrap:
        return [m for m in model.modules() if type(m).__name__ in wrap and m is not model]
    found: List[torch.nn.Module] = []
    for child in model.children():
        inner = list(child.children()) if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) else []
        found += [m for m in (inner or [child]) if any(True for _ in m.parameters())]
    return found


def checkpoint_activations(model: torch.nn.Module, mode: str, wrap: Tuple[str, ...] = ()) -> int:
    """Wrap the blocks ``mode`` names (in place); how many were wrapped.

    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    >>> checkpoint_activations(m, "full"), sorted(m.state_dict())
    (2, ['0.bias', '0.weight', '2.bias', '2.weight'])
    """
    if mode == "none":
        return 0
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    chosen = blocks(model, wrap)
    if mode == "selective":
        chosen = chosen[::2]
    ids = {id(m) for m in chosen}
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda module: id(module) in ids)
    return len(chosen)
