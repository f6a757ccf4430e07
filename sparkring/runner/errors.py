"""Exceptions the runner raises on the driver."""
from __future__ import annotations


class SparkRingError(RuntimeError):
    """Base class of sparkring's runtime errors."""


class ConfigurationError(SparkRingError, ValueError):
    """The Spark session or the arguments cannot run the job; raised before any Spark job."""


class RankFailedError(SparkRingError):
    """A rank raised (or its process died); carries the rank and its traceback.

    >>> try:
    ...     run(fn, num_proc=2)
    ... except RankFailedError as e:
    ...     print(e.rank, e.remote_traceback)  # doctest: +SKIP
    """

    def __init__(self, rank: int, remote_traceback: str, exit_code=None):
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exit_code = exit_code
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


class RankTimeoutError(SparkRingError, TimeoutError):
    """A rank ran past ``timeout`` (or the ranks did not all start within ``start_timeout``)."""

    def __init__(self, message: str, ranks=()):
        self.ranks = list(ranks)
        super().__init__(message)


# How a rank fails when *another* rank died under it: its transport lost the peer.
_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "was stopped:")


def is_secondary(traceback_text: str) -> bool:
    """True for a failure that only says a peer went away (the cause is another rank's error).

    >>> is_secondary("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    True
    """
    return any(sign in traceback_text for sign in _PEER_LOSS)
