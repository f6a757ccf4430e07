"""A model's initial values given module by module at full size, each rank keeping its slice of
every sharded parameter: what FSDP2 leaves to the caller of a meta-built model, and what a
checkpoint on storage does not hold.

DTensor's random ops draw per shard, so each module that holds parameters is initialized on its own
at full size (how: its ``reset_parameters()``, the user's ``initFn``, or the Hugging Face model
holding it), in module order from the seed: at most one module is ever whole in memory, and the same
seed gives the values ``torch.manual_seed(seed); factory()`` gives, at any numProc."""
from __future__ import annotations

from typing import AbstractSet, Callable, Optional

import torch

# what wrappers add to a tensor's name (activation checkpointing, FSDP1, torch.compile): not a checkpoint's
WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")

How = Callable[[str, torch.nn.Module], Optional[Callable[[], None]]]


def plain_name(name: str) -> str:
    """A tensor's name without what wrappers add to it.

    >>> plain_name("layers.0._checkpoint_wrapped_module.mlp.weight")
    'layers.0.mlp.weight'
    """
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def reset_or_init_fn(init_fn: Optional[Callable[[torch.nn.Module], None]]) -> How:
    """How a plain model's modules start: ``init_fn``, else their own ``reset_parameters()``."""
    def how(name: str, module: torch.nn.Module) -> Optional[Callable[[], None]]:
        if init_fn is not None:
            return lambda: init_fn(module)
        return getattr(module, "reset_parameters", None)

    return how


def initialize_modules(model: torch.nn.Module, seed: int, how: How, skip: AbstractSet[str] = frozenset()) -> None:
    """Give every module its initial values (``how`` says how), one module at a time at full size,
    then keep this rank's slice of each sharded parameter; a module whose tensors are all named in
    ``skip`` (filled from storage afterwards) is left as it is.

    >>> initialize_modules(model, 0, reset_or_init_fn(None))  # doctest: +SKIP
    """
    torch.manual_seed(seed)
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        buffers = [n for n, _ in module.named_buffers(recurse=False)]
        if not own and not buffers:
            continue
        if {plain_name(f"{name}.{n}" if name else n) for n in [*own, *buffers]} <= skip:
            continue
        reset = how(name, module)
        if reset is None:
            raise ValueError(f"module {name or '<root>'} ({type(module).__name__}) has parameters or buffers but no "
                             "reset_parameters() to initialize them after sharding; pass initFn=lambda module: ... "
                             "(called for every module that holds parameters)")
        _at_full_size(module, own, reset)


def _at_full_size(module: torch.nn.Module, own: dict, reset: Callable[[], None]) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = {n: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device
                                              if isinstance(p, DTensor) else p.device), requires_grad=False)
            for n, p in own.items()}
    for n, f in full.items():
        module._parameters[n] = f
    try:
        with torch.no_grad():
            reset()
    finally:
        for n, p in own.items():
            module._parameters[n] = p
    with torch.no_grad():
        for n, p in own.items():
            value = full[n].detach()
            if isinstance(p, DTensor):
                # every rank computed the same full value: each keeps its slice, no transfer
                p.to_local().copy_(distribute_tensor(value, p.device_mesh, p.placements,
                                                     src_data_rank=None).to_local())
            else:
                p.copy_(value)
