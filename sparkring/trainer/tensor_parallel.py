"""Which modules tensor parallelism splits and how (the parallelizePlan, resolved against the model),
and the default plans for torch's transformer layers and Llama-style blocks. torch's
``parallelize_module`` does the splitting; this module only decides what it is asked to split.

>>> resolve_plan(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
...              {"0": "colwise", "2": "rowwise"})
{'0': 'colwise', '2': 'rowwise'}
"""
from __future__ import annotations

import fnmatch
from typing import Any, Callable, Dict, List, Union

import torch

STYLES = ("colwise", "rowwise", "sequence")
Plan = Union[Dict[str, Any], Callable[[torch.nn.Module, Any], torch.nn.Module], None]

# Llama-style blocks (Hugging Face's names): attention q/k/v split by heads, o joins them; the MLP's
# gate/up split by features, down joins them; one allreduce after attention and one after the MLP.
LLAMA_STYLES = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
                "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}


class PlanError(ValueError):
    """A parallelizePlan that does not fit the model (raised before any Spark job)."""


def default_plan(model: torch.nn.Module) -> Dict[str, str]:
    """The plan used when parallelizePlan is unset: torch's TransformerEncoderLayer/DecoderLayer
    split their feed-forward block (linear1 colwise, linear2 rowwise; nn.MultiheadAttention's packed
    projection stays whole on every rank), and Llama-style blocks split attention and MLP (LLAMA_STYLES).

    >>> default_plan(torch.nn.TransformerEncoderLayer(8, 2, 16))
    {'linear1': 'colwise', 'linear2': 'rowwise'}
    """
    plan: Dict[str, str] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)):
            plan.update({f"{prefix}linear1": "colwise", f"{prefix}linear2": "rowwise"})
        for child, style in LLAMA_STYLES.items():
            if isinstance(getattr(module, child, None), torch.nn.Linear):
                plan[f"{prefix}{child}"] = style
    if not plan:
        raise PlanError(f"tensorParallel: no default plan for {type(model).__name__} (it has no "
                        "TransformerEncoderLayer/DecoderLayer and no Llama-style q_proj/o_proj/gate_proj/up_proj/"
                        "down_proj); pass parallelizePlan={'<module name pattern>': 'colwise' | 'rowwise', ...}")
    return plan


def resolve_plan(model: torch.nn.Module, plan: Dict[str, Any], strict: bool = True) -> Dict[str, Any]:
    """``plan``'s patterns (fnmatch on module names) expanded to the modules they name, each
    with its style; refused naming every pattern that matches nothing, and every style that is not
    one of STYLES (or a torch ParallelStyle), or a colwise/rowwise module that is no Linear/Embedding.
    ``strict=False``: a pipeline stage, which holds some of the modules the plan names."""
    from torch.distributed.tensor.parallel import ParallelStyle

    names = [n for n, _ in model.named_modules() if n]
    modules = dict(model.named_modules())
    resolved: Dict[str, Any] = {}
    unmatched: List[str] = []
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle) and style not in STYLES:
            raise PlanError(f"parallelizePlan[{pattern!r}] = {style!r}: use one of {', '.join(STYLES)} or a "
                            "torch.distributed.tensor.parallel ParallelStyle")
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            unmatched.append(pattern)
        for name in matched:
            if style in ("colwise", "rowwise") and not isinstance(modules[name], (torch.nn.Linear, torch.nn.Embedding)):
                raise PlanError(f"parallelizePlan: {name!r} is a {type(modules[name]).__name__}; {style} splits "
                                "a Linear or an Embedding only: name the Linear layers inside it")
            resolved[name] = style
    if unmatched and strict:
        shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
        raise PlanError(f"parallelizePlan names module(s) the model does not have: {unmatched}; its modules are "
                        f"{shown}")
    return resolved


def torch_styles(resolved: Dict[str, Any]) -> Dict[str, Any]:
    """The resolved plan as torch ParallelStyles, for ``parallelize_module``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    make = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}
    return {name: make[style]() if isinstance(style, str) else style for name, style in resolved.items()}


def parallelize(model: torch.nn.Module, plan: Plan, tp_mesh: Any, strict: bool = True) -> torch.nn.Module:
    """``model`` with its planned modules split over ``tp_mesh`` (a callable plan does it itself)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if callable(plan):
        return plan(model, tp_mesh)
    if plan is None and not strict:
        plan = {pattern: style for pattern, style in _default_or_empty(model).items()}
    resolved = resolve_plan(model, plan if plan is not None else default_plan(model), strict)
    return parallelize_module(model, tp_mesh, torch_styles(resolved))


def _default_or_empty(model: torch.nn.Module) -> Dict[str, str]:
    """A stage's part of the default plan (a stage may hold none of the planned layers)."""
    try:
        return default_plan(model)
    except PlanError:
        return {}
