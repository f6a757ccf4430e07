"""What a host of ranks (the runner) uses of the collective: the transports it may choose, and
the calls around the user's function inside a rank. The runner imports this, never the
collective's private modules."""
from __future__ import annotations

from typing import Tuple

from . import _runtime, _torchrun

TRANSPORTS: Tuple[str, ...] = tuple(_runtime.BACKENDS)  # the one list of backends a ring can use


def before_user_code() -> None:
    """Ready the rank for the user's function: a torchrun-style ``init_process_group`` of its own
    is adopted rather than refused (sparkring joins the ring lazily, at the first collective).

    >>> before_user_code()  # doctest: +SKIP
    """
    _torchrun.install()


def after_user_code() -> None:
    """Leave the ring for good: the rank's process is about to end.

    >>> after_user_code()  # doctest: +SKIP
    """
    _runtime.close()
