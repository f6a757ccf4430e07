"""Every public error of sparkring, all under SparkRingError; every layer raises these.

>>> from sparkring.errors import SparkRingError, RankFailedError
>>> try:
...     est.fit(df)
... except RankFailedError as e:
...     print(e.rank, e.remote_traceback)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Dict, Optional


class SparkRingError(RuntimeError):
    """Base class of every error sparkring raises on purpose."""


class ConfigurationError(SparkRingError, ValueError):
    """The Spark session or the arguments cannot run the job; raised before any Spark job."""


class DataError(SparkRingError, ValueError):
    """The DataFrame cannot be turned into tensors; the message names the column and the fix."""


class StoreError(SparkRingError, OSError):
    """The store cannot be used (unwritable path, unknown scheme...)."""


class RankFailedError(SparkRingError):
    """A rank raised (or its process died); carries the rank and its traceback.

    >>> try:
    ...     run(fn, num_proc=2)
    ... except RankFailedError as e:
    ...     print(e.rank, e.remote_traceback)  # doctest: +SKIP
    """

    def __init__(self, rank: int, remote_traceback: str, exit_code=None, executor: Optional[str] = None,
                 exception_type: Optional[str] = None, message: Optional[str] = None):
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exit_code = exit_code
        self.executor = executor  # the Spark executor (host:port) that ran the rank, where known
        self.exception_type = exception_type  # type_name() of what the rank raised, where it raised
        self.message = message  # str() of what the rank raised
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")

    def raised(self, cls: type) -> bool:
        """Whether the rank raised ``cls`` (this exact type, named as type_name() names it).

        >>> RankFailedError(1, "...", exception_type=type_name(NonFiniteLossError)).raised(NonFiniteLossError)
        True
        """
        return self.exception_type == type_name(cls)


def type_name(cls: type) -> str:
    """How an exception's type travels from a rank to the driver: module and qualified name.

    >>> type_name(ValueError)
    'builtins.ValueError'
    """
    return f"{cls.__module__}.{cls.__qualname__}"


class NonFiniteLossError(SparkRingError, FloatingPointError):
    """Raised on a rank whose loss is not finite (onNonFinite='raise'); the driver turns it into a
    TrainingError with this message, which names the epoch, step and rank.

    >>> str(NonFiniteLossError("non-finite loss nan at epoch 1, step 2 on rank 1"))
    'non-finite loss nan at epoch 1, step 2 on rank 1'
    """


class RankTimeoutError(SparkRingError, TimeoutError):
    """A rank ran past ``timeout`` (or the ranks did not all start within ``start_timeout``)."""

    def __init__(self, message: str, ranks=()):
        self.ranks = list(ranks)
        super().__init__(message)


class StageLostError(SparkRingError):
    """The barrier stage failed before any rank could say why: an executor (or its host) was lost.
    ``lost`` maps the ranks whose tasks went away to their executors' addresses (where known).

    >>> StageLostError("rank 1's task went away", lost={1: "10.0.0.7:41113"}).lost
    {1: '10.0.0.7:41113'}
    """

    def __init__(self, message: str, lost: Optional[Dict[int, str]] = None):
        self.lost = dict(lost or {})
        super().__init__(message)


class HostLostError(StageLostError):
    """Ranks fell silent past ``heartbeatTimeout`` while their tasks ran: their host no longer
    reaches the driver (a link down, every packet dropped, the machine hung) or their executor
    froze. ``lost`` maps the silent ranks to their executors' addresses, ``hosts`` to their hosts.

    >>> HostLostError("rank 1 on host b fell silent", lost={1: "b:4711"}, hosts={1: "b"}).hosts
    {1: 'b'}
    """

    def __init__(self, message: str, lost: Optional[Dict[int, str]] = None, hosts: Optional[Dict[int, str]] = None):
        self.hosts = dict(hosts or {})
        super().__init__(message, lost=lost)


class TrainingError(RankFailedError):
    """Training went wrong on a rank (a non-finite loss): the reason names the epoch, step and
    rank; the last good checkpoint is kept, so fitting again with the same runId resumes.

    >>> try:
    ...     est.fit(df)
    ... except TrainingError as e:
    ...     print(e.reason)  # doctest: +SKIP
    non-finite loss nan at epoch 3, step 120 on rank 1
    """

    def __init__(self, rank: int, remote_traceback: str, reason: str):
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exit_code = None
        self.executor = None
        self.exception_type = type_name(NonFiniteLossError)
        self.message = reason
        self.reason = reason
        SparkRingError.__init__(self, f"{reason}; the last good checkpoint is kept (fit again with the same "
                                      f"runId to resume, or set onNonFinite='skip_step')\n{remote_traceback}")


class NotInitializedError(SparkRingError):
    """A collective was called before ``init()`` (or after ``shutdown()``)."""


class HorovodInternalError(SparkRingError):
    """A collective failed inside the transport because a peer rank went away (the ring
    broke); as in Horovod, elastic code catches it to restart from a checkpoint. Raised by
    gloo/NCCL rings; an MPI ring aborts instead (MPI's errors are fatal by default)."""


# How a transport reports that *another* rank went away under a collective.
PEER_LOSS_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "was stopped:")


def is_peer_loss(text: str) -> bool:
    """True for an error text that only says a peer rank went away.

    >>> is_peer_loss("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    True
    """
    return any(sign in text for sign in PEER_LOSS_SIGNS)


class HostsUpdatedInterrupt(SparkRingError):
    """Raised by ``state.commit()`` inside ``sparkring.collective.elastic.run`` when the driver
    has more task slots again or an executor is leaving: the launch ends at that commit and the
    driver launches again with the ranks there are (Horovod's exception of the same name)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the hosts of this run changed: the ranks stop at this commit and start again from it")
        self.skip_sync = skip_sync


class MismatchError(SparkRingError, ValueError):
    """Ranks called a collective with different arguments (raised on every rank, as Horovod
    raises for mismatched tensors)."""


class ChannelError(SparkRingError):
    """A frame on the driver channel was malformed, too big or not signed with the run's secret."""
