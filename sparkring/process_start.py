"""How sparkring starts its child processes (ranks, reader workers): fork or a fresh
interpreter, decided in this one place, with the reason.

Forking saves importing torch again (seconds per rank). It is unsafe only where the child would
need CUDA again (a CUDA context does not survive fork) and off Linux. Other threads in the parent
(pyarrow's jemalloc background thread, gloo's loops, the reader's prefetch thread) are not a
reason: the libraries that own them register fork handlers, and the one abort seen beside them
came from the rank closing descriptors its inherited Python objects still owned
(runner/_process.release_inherited), not from a thread.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Mapping, Optional

log = logging.getLogger(__name__)

START_VARIABLE = "SPARKRING_WORKER_START"  # fork | spawn: the user's override
METHODS = ("fork", "spawn")


@dataclass(frozen=True)
class StartMethod:
    """How to start a child process, and why (logged when it is not the fast path).

    >>> start_method(uses_gpu=False, env={}).method
    'fork'
    >>> start_method(uses_gpu=True, env={}).reason
    'it uses a GPU, and a CUDA context does not survive fork'
    """

    method: str
    reason: str

    @property
    def forks(self) -> bool:
        """Whether ranks start by forking this process."""
        return self.method == "fork"


def start_method(uses_gpu: bool, env: Optional[Mapping[str, str]] = None) -> StartMethod:
    """``fork`` unless the child uses a GPU, this process has initialised CUDA, or this is not
    Linux; ``SPARKRING_WORKER_START`` (in ``env``, default os.environ) overrides.

    >>> start_method(uses_gpu=False, env={"SPARKRING_WORKER_START": "spawn"}).method
    'spawn'
    """
    env = os.environ if env is None else env
    chosen = env.get(START_VARIABLE, "")
    if chosen:
        if chosen not in METHODS:
            raise ValueError(f"{START_VARIABLE}={chosen!r}: use one of {', '.join(METHODS)}")
        return StartMethod(chosen, f"{START_VARIABLE}={chosen}")
    if not sys.platform.startswith("linux"):
        return StartMethod("spawn", f"fork is not used on {sys.platform}")
    if uses_gpu:
        return StartMethod("spawn", "it uses a GPU, and a CUDA context does not survive fork")
    if cuda_initialized():
        return StartMethod("spawn", "this process has initialised CUDA, which a forked child cannot use")
    return StartMethod("fork", "forked from a process with torch loaded")


def cuda_initialized() -> bool:
    """Whether this process holds a CUDA context (never imports torch to find out)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without CUDA support
        return False


def log_if_spawning(what: str, start: StartMethod) -> None:
    """One line saying why ``what`` starts a fresh interpreter instead of forking."""
    if not start.forks:
        log.info("%s start a fresh interpreter (spawn): %s", what, start.reason)
