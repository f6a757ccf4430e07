"""The session's reuse cache: DataFrames already prepared (same plan, spec and split) -> their Dataset."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Dict, Hashable, Optional

if TYPE_CHECKING:  # the Dataset deletes its entry here: no import back at run time
    from .dataset import Dataset

_cache: Dict[Hashable, "Dataset"] = {}
_lock = threading.Lock()


def lookup(key: Optional[Hashable]) -> Optional["Dataset"]:
    """The Dataset prepared under ``key`` if its files still exist."""
    if key is None:
        return None
    with _lock:
        ds = _cache.get(key)
    return ds if ds is not None and ds.exists() else None


def remember(key: Optional[Hashable], ds: "Dataset") -> None:
    if key is not None:
        with _lock:
            _cache[key] = ds


def forget(data_dir: str) -> None:
    """Drop every entry whose files live in ``data_dir`` (they were deleted)."""
    with _lock:
        for k in [k for k, v in _cache.items() if v.data_dir == data_dir]:
            del _cache[k]
