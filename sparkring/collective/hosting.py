"""What a host of ranks (the runner) uses of the collective: the transports it may choose, and
the calls around the user's function inside a rank. The runner imports this, never the
collective's private modules."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence

from . import _group_lifetime, _runtime, _torchrun, elastic, environment, timeline


@dataclass(frozen=True)
class Transport:
    """What the launcher and the estimator need to know of a backend, written once here.

    >>> transport("mpi").starts_under_mpiexec, transport("gloo").torch_distributed
    (True, True)
    """

    name: str
    torch_distributed: bool  # a torch.distributed process group: DTensor and FSDP2 run over it
    needs_gpus: bool  # one whole GPU per rank (NCCL)
    starts_under_mpiexec: bool  # each rank starts under `mpiexec -n 1` (MPI_Init needs it), with mpi4py


# the one list of backends a ring can use (each one a transport _runtime can load)
TRANSPORTS: Dict[str, Transport] = {
    "gloo": Transport("gloo", torch_distributed=True, needs_gpus=False, starts_under_mpiexec=False),
    "nccl": Transport("nccl", torch_distributed=True, needs_gpus=True, starts_under_mpiexec=False),
    "mpi": Transport("mpi", torch_distributed=False, needs_gpus=False, starts_under_mpiexec=True),
}
assert set(TRANSPORTS) == set(_runtime.BACKENDS)


def transport(name: str) -> Transport:
    """The transport a backend name (as a LaunchPlan holds it, never "auto") stands for."""
    return TRANSPORTS[name]


def before_user_code() -> None:
    """Ready the rank for the user's function: a torchrun-style ``init_process_group`` of its own
    is adopted rather than refused (sparkring joins the ring lazily, at the first collective).

    >>> before_user_code()  # doctest: +SKIP
    """
    _torchrun.install()
    _group_lifetime.install()
    if timeline.requested():  # run() with SPARKRING_TIMELINE / HOROVOD_TIMELINE: this rank records
        timeline.recorder.start(environment.RankEnv.from_env().rank)
        timeline.recorder.user_code_began = timeline.recorder.now()


def call_user_code(fn: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]]) -> Any:
    """``fn(*args, **kwargs)``; a function that stopped at an elastic commit because the driver
    asked returns ``elastic.Paused`` instead (the driver launches again from that commit).

    >>> call_user_code(max, (1, 2), None)
    2
    """
    try:
        return fn(*args, **(kwargs or {}))
    except elastic.StopAtCommit as stop:
        return elastic.Paused(commits=stop.commits)


def timeline_events() -> Optional[dict]:
    """This rank's timeline as the event run()'s driver merges (None when none was asked for).

    >>> timeline_events() is None  # doctest: +SKIP
    True
    """
    tl = timeline.recorder
    if not tl.on:
        return None
    began, joined = tl.joined_us
    if joined:
        tl.add("start-up: join the ring (rendezvous, transports)", began, joined)
    tl.add("your function", tl.user_code_began, tl.now())
    events = tl.events()
    tl.stop()
    return {timeline.EVENTS_KEY: events}


def after_user_code() -> None:
    """Leave the ring for good: the rank's process is about to end. A group the user's code
    made and left open is destroyed too (torch warns about groups never destroyed, and NCCL
    may hang at exit).

    >>> after_user_code()  # doctest: +SKIP
    """
    import torch.distributed as dist

    _runtime.close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _group_lifetime.release()
