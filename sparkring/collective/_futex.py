"""Sleep on, and wake, a 32-bit word in memory shared between processes (Linux futex).

Written by hand because nothing in Python's standard library or torch sleeps on a word of a
shared mapping: a rank waiting at the shared-memory ring for a slower peer sleeps here instead
of spinning, and gives its core to the threads that need it (the peer, a data-decoding thread).
Linux x86-64 only, as the ring is; ``available()`` says whether it works here.
"""
from __future__ import annotations

import ctypes
import platform

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT = 0  # not FUTEX_PRIVATE_FLAG: the word is shared between processes
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall():
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


_CALL = _syscall()


def available() -> bool:
    """Whether futexes work here (Linux on x86-64).

    >>> isinstance(available(), bool)
    True
    """
    return _CALL is not None


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``address`` still holds ``expected``, at most ``timeout_s``
    (returns at once when it already differs; a wake, a timeout or a signal all return).

    >>> import numpy as np; word = np.zeros(1, dtype=np.int32)
    >>> wait(word.ctypes.data, 1, 0.01)  # the word is 0, not 1: returns at once
    """
    whole = int(timeout_s)
    span = _Timespec(whole, int((timeout_s - whole) * 1e9))
    _CALL(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(expected), ctypes.byref(span), None, 0)


def wake(address: int) -> None:
    """Wake every process sleeping on the int32 at ``address`` (cheap when none is).

    >>> import numpy as np; wake(np.zeros(1, dtype=np.int32).ctypes.data)
    """
    _CALL(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
