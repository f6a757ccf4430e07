"""What a host of ranks (the runner) uses of the collective: the transports it may choose, and
the calls around the user's function inside a rank. The runner imports this, never the
collective's private modules."""
from __future__ import annotations

from typing import Optional, Tuple

from . import _runtime, _torchrun, environment, timeline

TRANSPORTS: Tuple[str, ...] = tuple(_runtime.BACKENDS)  # the one list of backends a ring can use


def before_user_code() -> None:
    """Ready the rank for the user's function: a torchrun-style ``init_process_group`` of its own
    is adopted rather than refused (sparkring joins the ring lazily, at the first collective).

    >>> before_user_code()  # doctest: +SKIP
    """
    _torchrun.install()
    if timeline.requested():  # run() with SPARKRING_TIMELINE / HOROVOD_TIMELINE: this rank records
        timeline.recorder.start(environment.RankEnv.from_env().rank)
        timeline.recorder.user_code_began = timeline.recorder.now()


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
    """Leave the ring for good: the rank's process is about to end.

    >>> after_user_code()  # doctest: +SKIP
    """
    _runtime.close()
