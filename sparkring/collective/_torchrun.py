"""torchrun habits inside a rank: a script's own ``dist.init_process_group(...)`` works whether or
not sparkring.collective formed the default group first.

torch.distributed refuses a second default group ("trying to initialize the default process
group twice!"), so a script that calls ``sr.rank()`` (or anything that makes sparkring join the
ring) before its own ``init_process_group`` would fail. Inside a sparkring run that call is
therefore adopted: when sparkring already owns a default group of the same world, the call
returns and the script uses that group. Nothing in torch offers this hook, hence the wrapper.
"""
from __future__ import annotations

import functools
import inspect
import logging

import torch.distributed as dist

log = logging.getLogger(__name__)
_installed = False


def install() -> None:
    """Wrap ``torch.distributed.init_process_group`` for this process (idempotent)."""
    global _installed
    if _installed:
        return
    original = dist.init_process_group

    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        from . import _runtime

        owner = _runtime.state.backend
        if not (dist.is_initialized() and owner is not None and getattr(owner, "_owns_group", False)):
            return original(*args, **kwargs)
        asked = signature.bind_partial(*args, **kwargs).arguments
        wanted = str(asked.get("backend") or "").lower()
        have = str(dist.get_backend()).lower()
        if wanted and not any(part.split(":")[-1] in have for part in wanted.split(",")):
            raise ValueError(
                f"init_process_group(backend={wanted!r}): sparkring.collective already formed the default "
                f"group with backend {have!r}; call init_process_group before any sparkring.collective "
                f"call, or launch with backend={wanted!r}")
        world_size = asked.get("world_size", -1)
        if world_size not in (-1, None) and world_size != dist.get_world_size():
            raise ValueError(f"init_process_group(world_size={world_size}): this run has "
                             f"{dist.get_world_size()} ranks")
        log.info("init_process_group: reusing the default group sparkring.collective formed (%s)", have)
        return None

    dist.init_process_group = init_process_group
    try:  # code that imported it from the submodule sees the same function
        import torch.distributed.distributed_c10d as c10d

        c10d.init_process_group = init_process_group
    except ImportError:  # pragma: no cover - every supported torch has the module
        pass
    _installed = True
