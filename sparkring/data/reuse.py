"""The session's reuse cache: DataFrames already prepared (same plan, spec and split) -> their Dataset."""
from __future__ import annotations

import contextlib
import threading
from typing import Dict, Hashable, Iterator, Optional, Protocol


class Prepared(Protocol):
    """What the cache needs of a prepared Dataset (which imports this module, so not the class)."""

    data_dir: str

    def exists(self) -> bool:
        """Whether the prepared data is still there to reuse."""


_cache: Dict[Hashable, Prepared] = {}
_lock = threading.Lock()
_preparing: Dict[Hashable, threading.Lock] = {}


def lookup(key: Optional[Hashable]) -> Optional[Prepared]:
    """The Dataset prepared under ``key`` if its files still exist."""
    if key is None:
        return None
    with _lock:
        ds = _cache.get(key)
    return ds if ds is not None and ds.exists() else None


@contextlib.contextmanager
def preparing(key: Optional[Hashable]) -> Iterator[None]:
    """Held while ``key``'s DataFrame is prepared: another thread preparing the same waits, then
    finds it in the cache (one copy for concurrent fits of one DataFrame).

    >>> with preparing(("df", 1)):
    ...     pass
    """
    if key is None:
        yield
        return
    with _lock:
        lock = _preparing.setdefault(key, threading.Lock())
    with lock:
        yield


def remember(key: Optional[Hashable], ds: Prepared) -> None:
    """Keep ``ds`` as the prepared copy of the DataFrame ``key`` names (None: nothing to reuse by)."""
    if key is not None:
        with _lock:
            _cache[key] = ds


def forget(data_dir: str) -> None:
    """Drop every entry whose files live in ``data_dir`` (they were deleted)."""
    with _lock:
        for k in [k for k, v in _cache.items() if v.data_dir == data_dir]:
            del _cache[k]
