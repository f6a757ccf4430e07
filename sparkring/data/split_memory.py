"""A split's row groups decoded into one array per column and held for later epochs; in a
segment the ranks of one host share, each row group is decoded once for all of them.

In a shared segment every row group has a progress word (its rows decoded so far, in order) and a
claim (a byte-range lock on the segment, which the kernel drops when its process dies): the first
rank that needs a row group claims it and decodes it, slice after slice, raising the progress
word after each; a rank that needs it meanwhile reads the slices as the word covers them, and
takes the claim over when it falls free before the row group is whole (a decoder that stopped or
died). Decoding the same rows again writes the same bytes, so a reader never sees them change.
"""
from __future__ import annotations

import fcntl
import mmap
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Set, Tuple

import numpy as np

Unit = Tuple[str, int, int]  # (file, row group, rows)
Key = Tuple[str, int]
# (path, row group index) -> the row group's arrays, slice after slice, in order
RowGroupSlices = Callable[[str, int], Iterator[Dict[str, np.ndarray]]]

_ALIGN = 64
_FOLLOW_SLEEP_S = 0.001  # how often a rank reading another's row group looks at its progress


@dataclass
class Piece:
    """Rows ``lo:hi`` of one row group, decoded; ``start`` is where they sit in the split's
    in-memory arrays (None when the split is not held in memory)."""

    arrays: Dict[str, np.ndarray]
    rows: int
    start: Optional[int]


@dataclass(frozen=True)
class SplitLayout:
    """Where a split's columns sit in one buffer: after one int64 progress word per row group,
    each column's rows (``dtype`` and per-row ``shape``) at an aligned offset.

    >>> layout = SplitLayout.of(10, 2, {"x": ("float32", (4,)), "y": ("int64", ())})
    >>> layout.nbytes, layout.offsets["y"]
    (384, 256)
    """

    rows: int
    units: int
    columns: Dict[str, Tuple[str, Tuple[int, ...]]]
    offsets: Dict[str, int]
    nbytes: int

    @classmethod
    def of(cls, rows: int, units: int, columns: Dict[str, Tuple[str, Tuple[int, ...]]]) -> "SplitLayout":
        """Where each column of ``rows`` rows lives in one buffer that ``units`` writers fill."""
        at = _aligned(8 * units)
        offsets = {}
        for name, (dtype, shape) in columns.items():
            offsets[name] = at
            at = _aligned(at + rows * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
        return cls(rows, units, dict(columns), offsets, max(at, _ALIGN))


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class SplitMemory:
    """A split's row groups decoded into one contiguous array per column, in storage order: in
    this process's memory, or (``shared``) in a segment this host's ranks map together.

    >>> memory = SplitMemory([("a.parquet", 0, 3)])
    >>> pieces = memory.pieces(("a.parquet", 0), 1, 3, lambda path, rg: iter([{"x": np.arange(3)}]))
    >>> [p.arrays["x"].tolist() for p in pieces], memory.holds(("a.parquet", 0))
    ([[1, 2]], True)
    """

    def __init__(self, units: Sequence[Unit], shared: Optional["SharedBuffer"] = None):
        self.offsets: Dict[Key, int] = {}
        self.rows: Dict[Key, int] = {}
        self.index: Dict[Key, int] = {}
        total = 0
        for i, (path, rg, n) in enumerate(units):
            self.offsets[(path, rg)], self.rows[(path, rg)], self.index[(path, rg)] = total, n, i
            total += n
        self.total = total
        self.arrays: Dict[str, np.ndarray] = {}
        self.shared = shared
        if shared is not None:
            self.arrays = shared.arrays()
            self._progress = shared.progress()
        else:
            self._progress = np.zeros(len(units), dtype=np.int64)
        self._claimed: Set[int] = set()  # this process's claims (record locks never conflict within one)
        self._claims = threading.Lock()

    def holds(self, key: Key) -> bool:
        """Whether the piece ``key`` is filled completely."""
        return self.filled(key) >= self.rows[key]

    def filled(self, key: Key) -> int:
        """Rows of row group ``key`` decoded so far (from its first row on)."""
        return int(self._progress[self.index[key]])

    def fill(self, key: Key, arrays: Dict[str, np.ndarray], at: int = 0) -> None:
        """Rows ``at:`` of row group ``key``; the progress word rises after the rows are written."""
        start = self.offsets[key] + at
        n = 0
        for c, a in arrays.items():
            if c not in self.arrays:
                self.arrays[c] = np.empty((self.total,) + a.shape[1:], dtype=a.dtype)
            np.copyto(self.arrays[c][start:start + len(a)], a, casting="no")
            n = len(a)
        i = self.index[key]
        self._progress[i] = max(int(self._progress[i]), at + n)

    def view(self, key: Key, lo: int, hi: int) -> Piece:
        """Rows ``lo`` to ``hi`` of the piece ``key``: views of the shared arrays, not copies."""
        start = self.offsets[key] + lo
        return Piece({c: a[start:start + hi - lo] for c, a in self.arrays.items()}, hi - lo, start)

    def pieces(self, key: Key, lo: int, hi: int, read_slices: RowGroupSlices) -> Iterator[Piece]:
        """Rows ``lo:hi`` of row group ``key`` as pieces, each as soon as it is in memory: held
        already, decoded here (the whole row group, for later epochs), or decoded by another rank
        of this host."""
        sent = lo
        while sent < hi:
            done = min(self.filled(key), hi)
            if done > sent:
                yield self.view(key, sent, done)
                sent = done
            elif self._claim(key):
                try:
                    if not self.holds(key):  # else it was finished meanwhile: read from memory
                        yield from self._decode(key, sent, hi, read_slices)
                        return
                finally:
                    self._release(key)
            else:
                time.sleep(_FOLLOW_SLEEP_S)

    def fill_every(self, read_slices: RowGroupSlices) -> None:
        """Every row group in memory: first those no other rank of the host is decoding, then
        the rest as those ranks finish them (or here, where one stops)."""
        for key, rows in self.rows.items():
            if not self.holds(key) and self._claim(key):
                try:
                    if not self.holds(key):
                        for _ in self._decode(key, rows, rows, read_slices):
                            pass
                finally:
                    self._release(key)
        for key, rows in self.rows.items():
            for _ in self.pieces(key, 0, rows, read_slices):
                pass

    def _decode(self, key: Key, sent: int, hi: int, read_slices: RowGroupSlices) -> Iterator[Piece]:
        at = 0
        for arrays in read_slices(*key):
            n = len(next(iter(arrays.values()))) if arrays else 0
            if at + n > self.filled(key):  # rows another decoder left are the same bytes: not written again
                self.fill(key, arrays, at)
            first, last = max(sent, at), min(hi, at + n)
            if first < last:
                yield self.view(key, first, last)
                sent = last
            at += n

    def _claim(self, key: Key) -> bool:
        i = self.index[key]
        with self._claims:
            if i in self._claimed:
                return False
            if self.shared is not None and not self.shared.lock(i):
                return False
            self._claimed.add(i)
            return True

    def _release(self, key: Key) -> None:
        i = self.index[key]
        with self._claims:
            self._claimed.discard(i)
            if self.shared is not None:
                self.shared.unlock(i)


class SharedBuffer:
    """A split's layout over a mapped segment (``mm``) whose descriptor ``fd`` carries the claims.

    >>> import mmap, tempfile
    >>> layout = SplitLayout.of(4, 1, {"x": ("float32", ())})
    >>> f = tempfile.TemporaryFile(); _ = f.truncate(layout.nbytes)
    >>> buffer = SharedBuffer(mmap.mmap(f.fileno(), layout.nbytes), f.fileno(), layout)
    >>> buffer.arrays()["x"].shape, buffer.lock(0)
    ((4,), True)
    """

    def __init__(self, mm: mmap.mmap, fd: int, layout: SplitLayout):
        self.mm, self.fd, self.layout = mm, fd, layout

    def arrays(self) -> Dict[str, np.ndarray]:
        """Each column's array over the buffer (views, not copies)."""
        out = {}
        for name, (dtype, shape) in self.layout.columns.items():
            count = self.layout.rows * int(np.prod(shape, dtype=np.int64))
            flat = np.frombuffer(self.mm, dtype=np.dtype(dtype), count=count, offset=self.layout.offsets[name])
            out[name] = flat.reshape((self.layout.rows,) + tuple(shape))
        return out

    def progress(self) -> np.ndarray:
        """How many rows each writer has written (the buffer's head)."""
        return np.frombuffer(self.mm, dtype=np.int64, count=self.layout.units)

    def lock(self, index: int) -> bool:
        """Claim row group ``index`` (byte ``index`` of the segment), without waiting."""
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, index)
            return True
        except OSError:
            return False

    def unlock(self, index: int) -> None:
        """Release writer ``index``'s lock."""
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, index)


def layout_columns(spec: Any, cols: Sequence[str]) -> Optional[Dict[str, Tuple[str, Tuple[int, ...]]]]:
    """Each column's (dtype, row shape) where every one is known before decoding, else None
    (bytes, or shapes a transformFn decides)."""
    out = {}
    for c in cols:
        col = spec.column(c)
        if not col.decided or col.kind == "bytes":
            return None
        out[c] = (str(np.dtype(col.dtype)), tuple(col.shape))
    return out

