"""The model's input layer against the features' width, before any Spark job: a forward on the
meta device (no memory, no compute) that stops at the first Linear or Embedding the features
reach, so a ``Linear(32, ...)`` on 64 features is refused naming both widths instead of failing
on every rank with torch's "mat1 and mat2 shapes cannot be multiplied". Written by hand: torch
has no call that says which layer a forward reaches first; the forward itself is the only
reliable answer for any architecture. The forward runs on a meta twin of the model, never on the
user's module: a CrossValidator fits grid points in threads, and another fit may be pickling the
same module into its task payload meanwhile."""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import List, Optional

import torch

from ..data import DataError, FeatureSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FirstLayer:
    """The first Linear or Embedding a forward reached, and what it was given."""

    name: str
    layer: torch.nn.Module
    given: torch.Tensor


class _Reached(Exception):
    """Stops the forward at the first layer that matters."""

    def __init__(self, found: FirstLayer):
        super().__init__(found.name)
        self.found = found


def first_layer(model: torch.nn.Module, inputs: List[torch.Tensor]) -> Optional[FirstLayer]:
    """The first Linear or Embedding ``model`` applies to ``inputs`` (meta tensors), found by a
    forward on the meta device; None where the forward reaches neither or cannot run on meta.

    >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(32, 10))
    >>> found = first_layer(net, [torch.empty(2, 4, 16, device="meta")])
    >>> found.name, found.given.shape[-1]
    ('1', 64)
    """
    twin = _meta_twin(model)
    if twin is None:
        return None
    names = {id(m): name for name, m in twin.named_modules()}

    def reached(module: torch.nn.Module, args: tuple) -> None:
        raise _Reached(FirstLayer(names.get(id(module), type(module).__name__), module, args[0]))

    for layer in twin.modules():
        if _torch_own_forward(layer):
            layer.register_forward_pre_hook(reached)
    try:
        twin(*inputs)
    except _Reached as stop:
        return stop.found
    except Exception as exc:  # noqa: BLE001 - a forward that needs real values: the ranks find out
        log.debug("the input layer check skipped: the forward does not run on meta (%s: %s)", type(exc).__name__, exc)
    return None


def _meta_twin(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """A copy of ``model`` whose parameters and buffers are empty meta tensors (no weights copied);
    None where the module cannot be copied (the check is then left to the ranks)."""
    tensors = [*model.parameters(), *model.buffers()]
    memo = {id(t): (torch.nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
                    if isinstance(t, torch.nn.Parameter) else torch.empty_like(t, device="meta"))
            for t in tensors}
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:  # noqa: BLE001 - a module holding something that does not copy (a lock, a handle)
        log.debug("the input layer check skipped: the model does not copy (%s: %s)", type(exc).__name__, exc)
        return None


def _torch_own_forward(module: torch.nn.Module) -> bool:
    """A Linear or Embedding whose forward is torch's: a subclass with its own forward may cast or
    reshape what it is given (``ids.long()``), so only what it passes on is judged."""
    return any(isinstance(module, kind) and type(module).forward is kind.forward
               for kind in (torch.nn.Linear, torch.nn.Embedding))


def check_input_layer(model: torch.nn.Module, spec: FeatureSpec) -> None:
    """Refuse a model whose first Linear does not take the width the features give it, or whose
    first Embedding would get floats (before any Spark job; a model with several inputs, a
    transformFn or a forward that needs real values is left to the ranks).

    >>> check_input_layer(torch.nn.Linear(32, 10), spec)  # doctest: +SKIP
    Traceback (most recent call last):
    DataError: the model's first layer 'Linear' is Linear(in_features=32, ...) but featuresCol ... gives it 64 ...
    """
    if len(spec.inputs) != 1 or spec.transform:
        return
    inp = spec.inputs[0]
    width = spec.input_width(inp)
    if width is None:
        return
    floats = not (inp.integral and len(inp.columns) == 1)
    row = inp.shape if inp.shape is not None else (width,)
    given = torch.empty(2, *row, dtype=torch.float32 if floats else torch.long, device="meta")
    found = first_layer(model, [given])
    if found is None:
        return
    columns = ", ".join(repr(c) for c in inp.columns)
    source = f"the feature column(s) {columns} ({width} values per row" + (
        f", reshaped by inputShapes to {list(inp.shape)})" if inp.shape is not None else ")")
    layer = found.layer
    if isinstance(layer, torch.nn.Linear) and found.given.shape[-1] != layer.in_features:
        raise DataError(
            f"the model's first layer {found.name!r} is Linear(in_features={layer.in_features}, "
            f"out_features={layer.out_features}) but {source} give it {found.given.shape[-1]} values: build it as "
            f"Linear({found.given.shape[-1]}, {layer.out_features}), or set featuresCol/inputShapes to the "
            f"{layer.in_features} values it expects")
    if isinstance(layer, torch.nn.Embedding) and found.given.is_floating_point():
        raise DataError(
            f"the model's first layer {found.name!r} is an Embedding, which takes integer ids, but {source} "
            "arrive as floats: give it one integer column (ids) as its own input, or start the model with a Linear")
