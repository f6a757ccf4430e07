"""Process groups outlive ``destroy_process_group`` until the rank's user code is over: a
workaround for a teardown deadlock in torch's Gloo groups, written by hand because torch has none.

In torch 2.13 every ``backward()`` stashes a ``contextvars.Context`` in thread-local state,
and each collective DDP starts inside backward copies that state into its Gloo work. When a
script calls ``destroy_process_group()`` and then drops its DDP model (returning from the
function, the end of a script), the model's Reducer can hold the last reference to the group:
its destructor runs with the GIL held and joins Gloo's worker threads, while a worker is still
freeing the last work and waits for the GIL to drop that context. Both wait for ever
(pytorch/pytorch#180700 describes the same race on autograd's device threads). Here about one
DDP function in four hung its rank.

Holding a reference to every destroyed group keeps the Reducer from being the last holder. The
groups are let go when the next group is made (``init_process_group``: code that makes and
destroys groups in a loop does not pile up their threads) and in ``release()`` after the user's
code; the last reference dropped from Python frees a group with the GIL released, so that is safe.
"""
from __future__ import annotations

import functools
from typing import Any, List

import torch.distributed as dist

_retired: List[Any] = []
_installed = False


def install() -> None:
    """Wrap ``destroy_process_group`` (keep the groups) and ``init_process_group`` (let them go) (idempotent).

    >>> install()  # doctest: +SKIP
    """
    global _installed
    if _installed:
        return
    import torch.distributed.distributed_c10d as c10d

    destroy, init = dist.destroy_process_group, dist.init_process_group

    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        _retired.extend(_groups_destroyed_by(group))
        return destroy(group)

    @functools.wraps(init)
    def init_process_group(*args, **kwargs):
        release()
        return init(*args, **kwargs)

    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group
    dist.init_process_group = c10d.init_process_group = init_process_group
    _installed = True


def _groups_destroyed_by(group: Any) -> List[Any]:
    import torch.distributed.distributed_c10d as c10d

    if group is not None and group is not dist.group.WORLD:
        return [group]
    world = getattr(c10d, "_world", None)  # every group, not only the default one
    groups = list(getattr(world, "pg_names", {}) or [])
    return groups or ([dist.group.WORLD] if dist.group.WORLD is not None else [])


def release() -> None:
    """Let go of the destroyed groups (their threads are idle once the user's code returned).

    >>> release()  # doctest: +SKIP
    """
    _retired.clear()
