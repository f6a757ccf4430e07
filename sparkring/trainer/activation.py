"""Activation checkpointing of a model's blocks (the activationCheckpointing Param): "full" recomputes
every block's activations in backward instead of keeping them, "selective" every other block.
torch's checkpoint wrapper does the work (non-reentrant; its state_dict hooks keep the keys plain)."""
from __future__ import annotations

import functools
from typing import Any, List, Literal, Tuple, get_args

import torch

ActivationCheckpointing = Literal["none", "full", "selective"]
MODES: Tuple[ActivationCheckpointing, ...] = get_args(ActivationCheckpointing)


def named_blocks(model: torch.nn.Module, wrap: Tuple[str, ...]) -> List[Tuple[str, torch.nn.Module]]:
    """The model's blocks in forward order, with their names: the modules whose class is named in
    ``wrap`` (by default the blocks the model declares: declared_blocks), else every child (and
    every layer of a top-level ModuleList/Sequential) that holds parameters.

    >>> [name for name, _ in named_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), ())]
    ['0']
    """
    wrap = wrap or declared_blocks(model)
    if wrap:
        named = [(n, m) for n, m in model.named_modules() if type(m).__name__ in wrap and m is not model]
        if named:
            return named
    found: List[Tuple[str, torch.nn.Module]] = []
    for name, child in model.named_children():
        inner = list(child.named_children()) if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) else []
        found += [(f"{name}.{n}" if inner else name, m) for n, m in (inner or [(name, child)])
                  if any(True for _ in m.parameters())]
    return found


def declared_blocks(model: torch.nn.Module) -> Tuple[str, ...]:
    """The block classes a model names itself: a Hugging Face model's ``_no_split_modules``
    (its decoder layers, e.g. ``LlamaDecoderLayer``), found on it or on a module it wraps (LoRA).

    >>> declared_blocks(torch.nn.Linear(2, 2))
    ()
    """
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return tuple(names)
    return ()


def blocks(model: torch.nn.Module, wrap: Tuple[str, ...]) -> List[torch.nn.Module]:
    """named_blocks' modules.

    >>> len(blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1)), ()))
    2
    """
    return [m for _, m in named_blocks(model, wrap)]


def without_kv_cache(model: torch.nn.Module) -> None:
    """A Hugging Face model trains without its KV cache (``config.use_cache``, on by default): a
    recomputed block would append to it twice, and with a cache the model takes restarting position
    ids for one sequence (no attention restart at each packed document). Generation asks for the
    cache itself.

    >>> without_kv_cache(torch.nn.Linear(2, 2))
    """
    for module in model.modules():
        config: Any = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False


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
