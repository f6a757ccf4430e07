"""What a joined rank does for the collectives the others still run: replay each one with
neutral inputs (see ``_join`` for how the recipes travel)."""
from __future__ import annotations

import importlib
from typing import Any, Tuple

import torch

from ..errors import MismatchError
from . import _checks, _reduce, _runtime, mpi_ops
from ._backend import Backend
from ._join import Joiner, Recipe
from ._reduce import Max, Min, Product


def _neutral(shape: Tuple[int, ...], dtype: torch.dtype, op: str) -> torch.Tensor:
    """What a joined rank contributes to an allreduce: the identity of ``op``."""
    if op in (Min, Max):
        if dtype == torch.bool:
            value: Any = op == Min
        elif dtype.is_floating_point:
            value = float("inf") if op == Min else float("-inf")
        else:
            info = torch.iinfo(dtype)
            value = info.max if op == Min else info.min
    else:
        value = 1 if op == Product else 0
    return torch.full(shape, value, dtype=dtype)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.split(".")[-1])


def replay(recipe: Recipe) -> None:
    """Run, on a joined rank, the collective the active ranks are running."""
    kind = recipe.kind
    me = _runtime.current().rank
    if kind == "allreduce":
        module, _, qualname = recipe.compression.partition(":")
        compression = importlib.import_module(module)
        for part in qualname.split("."):
            compression = getattr(compression, part)
        tensor = _neutral(recipe.shape, _dtype(recipe.dtype), recipe.op)
        # the path the active ranks took, so every rank runs matching transfers
        _reduce.allreduce_start(tensor, None, recipe.op, compression, recipe.prescale, recipe.postscale,
                            path=recipe.path, name=recipe.name or None, checked=recipe.checked).wait()
    elif kind in _checks.NOT_WITH_JOIN:
        # take part in the agreement step only, saying "joined": the active ranks then raise, as
        # Horovod's do for these collectives while a rank has joined; this one goes on serving
        _runtime.enter(recipe)  # numbered as the active ranks numbered it
        try:
            _checks.agree(kind, joined=True, name=recipe.name or None)
        except MismatchError:
            pass
    elif kind == "gather_objects":  # an internal agreement: a joined rank has nothing to say
        _runtime.gather_objects(None)
    elif kind == "negotiate":  # the others meet to run their queued async operations
        try:
            _checks.agree(_checks.SYNC, joined=True)  # numbers itself, as on the active ranks
        except MismatchError:
            pass  # the active ranks raise it; this one goes on serving
    elif kind == "barrier":
        mpi_ops.barrier()
    else:  # a newer peer: fail loudly rather than hang
        raise RuntimeError(f"join(): rank {me} cannot take part in a {kind!r} collective")


def _start_joiner(backend: Backend) -> None:
    stores = backend.join_stores()
    if stores is not None:  # a ring of more than one rank
        _runtime.state.joiner = Joiner(backend.rank, backend.size, stores[0], stores[1], replay)


_runtime.on_new_ring(_start_joiner)
