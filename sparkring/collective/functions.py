"""Horovod's helpers on top of the tensor collectives: objects (pickled), a model's parameters
and an optimizer's state, from one root to every rank."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

from . import _checks, _gather, _runtime
from ._join import Recipe
from .optimizer import local_step
from .process_sets import accepts_process_set


@accepts_process_set
def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None) -> Any:
    """Return root's (picklable) object on every rank.

    Arguments:
        obj: any picklable object (looked at on ``root_rank`` only).
        root_rank: the rank whose object every rank gets.
        name: a name the ranks agree on.
        process_set: broadcast within this ``sr.ProcessSet`` only.

    Returns:
        ``root_rank``'s object, unpickled on every rank.

    >>> sr.broadcast_object({"epoch": 3}, root_rank=0)  # doctest: +SKIP
    {'epoch': 3}
    """
    b = _runtime.current()
    _runtime.enter(Recipe("broadcast_object", root=root_rank, name=name or ""))
    _checks.agree("broadcast_object", root=root_rank, name=name)
    return b.broadcast_object(obj, b.group_rank(root_rank))


@accepts_process_set
def allgather_object(obj: Any, name: Optional[str] = None) -> List[Any]:
    """Return the list of every rank's (picklable) object, by rank.

    Arguments:
        obj: any picklable object.
        name: a name the ranks agree on.
        process_set: gather within this ``sr.ProcessSet`` only.

    Returns:
        The list of every rank's object, in rank order.

    >>> sr.allgather_object(sr.rank())  # doctest: +SKIP
    [0, 1]
    """
    b = _runtime.current()
    seq = _runtime.enter(Recipe("allgather_object", name=name or ""))
    _checks.agree("allgather_object", name=name)
    out = b.allgather_object(obj)
    _runtime.completed(seq)
    return out


@accepts_process_set
def broadcast_parameters(params: Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]],
                         root_rank: int = 0) -> None:
    """Copy root's parameters/buffers into every rank's, in place.

    Accepts ``model.state_dict()`` or ``model.named_parameters()``.

    Arguments:
        params: ``model.state_dict()``, ``model.named_parameters()``, or a list of (name, tensor).
        root_rank: the rank whose values every rank copies in place.
        process_set: broadcast within this ``sr.ProcessSet`` only.

    Returns:
        None; every tensor holds ``root_rank``'s values.

    >>> sr.broadcast_parameters(model.state_dict(), root_rank=0)  # doctest: +SKIP
    """
    items = sorted(params.items()) if isinstance(params, Mapping) else sorted(params, key=lambda kv: kv[0])
    handles = []
    for _, p in items:
        if not isinstance(p, torch.Tensor):
            raise TypeError("broadcast_parameters expects tensors; got " + type(p).__name__)
        target = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(_gather.broadcast_start(target, root_rank))
    for h in handles:
        h.wait()


@accepts_process_set
def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every rank's optimizer state (tensors, step counters, lr and other
    hyperparameters) equal to root's.

    Arguments:
        optimizer: a ``torch.optim.Optimizer`` (or a DistributedOptimizer) on every rank.
        root_rank: the rank whose state (and hyperparameters) every rank copies.
        process_set: broadcast within this ``sr.ProcessSet`` only.

    Returns:
        None; the optimizer's state and param groups on every rank are ``root_rank``'s.

    >>> sr.broadcast_optimizer_state(opt, root_rank=0)  # doctest: +SKIP
    """
    if not optimizer.state_dict()["state"]:
        _initialize_state(optimizer)
    state = optimizer.state_dict()
    # Tensors travel as tensors (cheap for big moments); everything else as one object.
    tensors: List[Tuple[Tuple, torch.Tensor]] = []
    skeleton: Dict[str, Any] = {"param_groups": state["param_groups"], "state": {}}
    for pid, pstate in state["state"].items():
        entry = {}
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor):
                tensors.append(((pid, key), value))
                entry[key] = ("__tensor__", tuple(value.shape), str(value.dtype))
            else:
                entry[key] = value
        skeleton["state"][pid] = entry
    root_skeleton = broadcast_object(skeleton, root_rank)
    root_keys = [(pid, key) for pid, e in root_skeleton["state"].items() for key, v in e.items()
                 if isinstance(v, tuple) and v and v[0] == "__tensor__"]
    local = dict(tensors)
    new_state: Dict[Any, Dict[str, Any]] = {}
    handles = []
    for pid, entry in root_skeleton["state"].items():
        new_state[pid] = {}
        for key, value in entry.items():
            if (pid, key) in root_keys:
                _, shape, dtype = value
                buf = local.get((pid, key))
                if buf is None or tuple(buf.shape) != shape or str(buf.dtype) != dtype:
                    buf = torch.zeros(shape, dtype=getattr(torch, dtype.split(".")[-1]))
                else:
                    buf = buf.clone()
                handles.append(_gather.broadcast_start(buf, root_rank))
                new_state[pid][key] = buf
            else:
                new_state[pid][key] = value
    for h in handles:
        h.wait()
    optimizer.load_state_dict({"state": new_state, "param_groups": root_skeleton["param_groups"]})


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's way to give a fresh optimizer (Adam & co. create state on their first step)
    the state the root will send: zero gradients (left in place, as Horovod does) and one plain
    step, never the distributed one (its allreduce would wait for ranks that do not step).
    Unlike Horovod, the weights are put back afterwards: a zero-gradient step still moves them
    under weight decay (AdamW, SGD's weight_decay), which would part this rank's model from the
    root's."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    try:
        local_step(optimizer)
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)


def check_same_shapes(named: List[Tuple[str, torch.Tensor]], what: str) -> None:
    """Check that every rank passes the same tensor names with the same shapes and dtypes.

    Arguments:
        named: this rank's ``(name, tensor)`` pairs, e.g. ``list(model.named_parameters())``.
        what: the caller's name, for the message (e.g. "DistributedOptimizer").

    Returns:
        None when every rank agrees; otherwise raises ValueError naming the tensor and the rank.

    >>> sr.check_same_shapes(list(model.named_parameters()), "my optimizer")  # doctest: +SKIP
    """
    _checks.agree_shapes(named, what)
