"""One rank's epoch of batches from prepared Parquet: which rows it reads, decoding row groups
in a background thread, keeping a split decoded in memory for later epochs, and cutting
(shuffled) batches on the consumer's side.

Decoding (pyarrow, which releases the GIL) runs ahead in a thread and hands over a row group
in slices of about SLICE_BYTES (``iter_batches``), so the first batch waits for one slice, not
for a whole row group (a Spark-written one is ~128 MB); batches are cut where they are consumed,
so a hand-over never costs as much as a small batch. Shuffling draws the first batches from the
first slice alone, the rest from windows of the rank's share (see ``shuffled``). When a split fits in MEMORY_BYTES
its row groups are decoded into one
contiguous array per column: later epochs decode nothing, and a shuffled batch is one
``np.take`` of sorted row indices per column.
"""
from __future__ import annotations

import queue
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .spec import TENSOR, DataError, FeatureSpec, flat_values, to_numpy
from .split_memory import Piece, RowGroupSlices, SplitMemory, Unit

# What one reader (one rank) keeps decoded in memory: a split decoded for later epochs, and
# the largest share shuffled as one window.
MEMORY_BYTES = 1 << 30

# Batches are views of decoded arrays, which numpy flags read-only where Arrow owns them;
# torch warns on each one (a catch_warnings per batch costs as much as the batch itself).
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)

def plan_rows(total: int, batch_size: int, rank: int, size: int, drop_last: bool) -> Tuple[int, int]:
    """(first row, row count) of ``rank``'s share of one epoch's row order."""
    if drop_last:
        per_rank = (total // (size * batch_size)) * batch_size
        return rank * per_rank, per_rank
    base, extra = divmod(total, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def row_bytes(spec: FeatureSpec, cols: Sequence[str]) -> int:
    """Decoded bytes per row (binary columns counted as 4 KiB)."""
    total = 0
    for c in cols:
        col = spec.column(c)
        total += 4096 if not col.decided else col.width() * np.dtype(col.dtype).itemsize
    return total


def share(units: Sequence[Unit], first: int, count: int) -> List[Tuple[str, int, int, int]]:
    """The (file, row group, lo, hi) pieces holding rows ``first:first+count`` of ``units``' order."""
    pieces = []
    offset = 0
    for path, rg, n in units:
        lo, hi = max(first, offset), min(first + count, offset + n)
        if lo < hi:
            pieces.append((path, rg, lo - offset, hi - offset))
        offset += n
    return pieces


# Reads one row group's columns as numpy arrays of rows: (path, row group index) -> arrays.
RowGroupReader = Callable[[str, int], Dict[str, np.ndarray]]

SLICE_BYTES = 8 << 20  # decoded bytes of one slice (a prepared copy's row group is about as big)


def slice_rows(spec: FeatureSpec, cols: Sequence[str]) -> int:
    """Rows of one slice: about SLICE_BYTES decoded, at least 1024."""
    return max(1024, SLICE_BYTES // max(1, row_bytes(spec, cols)))


def whole_groups(read: RowGroupReader) -> RowGroupSlices:
    """A reader of whole row groups as one slice each (petastorm's)."""
    return lambda path, rg: iter((read(path, rg),))


def _slices(parquet_file: Any, rg: int, columns: Sequence[str], rows: int) -> Iterator[Any]:
    """Row group ``rg`` as pyarrow tables of ``rows`` rows, decoded one after the other."""
    import pyarrow as pa

    for batch in parquet_file.iter_batches(batch_size=rows, row_groups=[rg], columns=list(columns),
                                           use_threads=False):
        yield pa.Table.from_batches([batch])


def arrow_row_groups(open_file: Callable[[str], Any], spec: FeatureSpec, cols: Sequence[str]) -> RowGroupSlices:
    """The default reader: pyarrow decodes the row group slice_rows rows at a time, ``to_numpy``
    each column."""
    files: Dict[str, Any] = {}
    rows = slice_rows(spec, cols)

    def read(path: str, rg: int) -> Iterator[Dict[str, np.ndarray]]:
        if path not in files:
            files[path] = open_file(path)
        for table in _slices(files[path], rg, cols, rows):
            yield {c: to_numpy(table.column(c), spec.column(c)) for c in cols}
    return read


def validation_rows(seed: int, file_index: int, row_group: int, rows: int, fraction: float) -> np.ndarray:
    """Which rows of a row group read in place are held out for validation: a draw seeded by
    the row group's place, so the driver counts and every rank reads the same rows."""
    return np.random.default_rng([seed, file_index, row_group, 4391]).random(rows) < fraction


# Which of a row group's rows a split keeps: (path, row group, rows) -> boolean mask.
RowSelector = Callable[[str, int, int], np.ndarray]


def source_row_groups(open_file: Callable[[str], Any], spec: FeatureSpec, cols: Sequence[str],
                      integral: Sequence[str] = (), keep: Optional[RowSelector] = None) -> RowGroupSlices:
    """The reader of Parquet a DataFrame scanned (read in place, not prepared), in slices of
    slice_rows rows: an ML vector's ``values`` list or a numeric array becomes one row per array,
    checked to hold the same number of elements on every row; a scalar is cast; the ``integral``
    columns (class-index labels) are checked to hold whole, non-negative numbers; ``keep`` picks
    the split's rows of the whole row group. DataError names the column."""
    files: Dict[str, Any] = {}
    leaves = [f"{c}.values" if spec.column(c).vector else c for c in cols]
    rows = slice_rows(spec, cols)

    def read(path: str, rg: int) -> Iterator[Dict[str, np.ndarray]]:
        if path not in files:
            files[path] = open_file(path)
        mask = None if keep is None else keep(path, rg, files[path].metadata.row_group(rg).num_rows)
        at = 0
        for table in _slices(files[path], rg, leaves, rows):
            arrays = {c: _source_column(table.column(c), spec.column(c), c in integral, path) for c in cols}
            if mask is not None:
                part = mask[at:at + table.num_rows]
                arrays = {c: a[part] for c, a in arrays.items()}
            at += table.num_rows
            yield arrays
    return read


def _check_class_indices(values: np.ndarray, name: str, path: str) -> None:
    """DataError naming the column and file unless ``values`` are whole, non-negative numbers."""
    if values.dtype.kind == "f" and not np.array_equal(values, np.floor(values)):
        bad = int(np.count_nonzero(values != np.floor(values)))
        raise DataError(f"column {name!r} has {bad} non-integral value(s) in {path}, but the loss needs "
                        "class indices 0..C-1; index the labels (StringIndexer) or use a regression loss")
    if len(values) and values.min() < 0:
        raise DataError(f"column {name!r} has negative value {values.min():g} in {path}; class indices start at 0")


def _source_column(column, col, integral: bool, path: str) -> np.ndarray:
    """One scanned column as rows: see source_row_groups."""
    import pyarrow as pa

    column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if column.null_count:
        raise DataError(f"column {col.name!r} has {column.null_count} null value(s) in {path}: fill them "
                        "(df.fillna / Imputer) or filter them out (df.dropna)")
    if col.kind != TENSOR:
        values = to_numpy(column, col)
        if integral:
            _check_class_indices(column.to_numpy(zero_copy_only=False), col.name, path)
        return values
    if pa.types.is_struct(column.type):
        column = column.field("values")
    lengths = np.diff(column.offsets.to_numpy())
    if np.any(lengths != col.width()):
        raise DataError(f"column {col.name!r} holds arrays of different lengths ({lengths.min()} to "
                        f"{lengths.max()}) in {path}; every row must have the same shape: pad or truncate them")
    nulls = column.flatten().null_count
    if nulls:
        raise DataError(f"column {col.name!r} has {nulls} null element(s) in {path}: fill or drop them")
    return flat_values(column, col).reshape(len(column), *col.shape)


def decoded_pieces(read_slices: RowGroupSlices, pieces: Sequence[Tuple[str, int, int, int]],
                   memory: Optional[SplitMemory]) -> Iterator[Piece]:
    """Each piece (rows ``lo:hi`` of a row group) as the slices that hold it, each as soon as it
    is decoded: through the split's memory (see SplitMemory.pieces), or without memory decoding
    up to ``hi``."""
    for path, rg, lo, hi in pieces:
        if memory is not None:
            yield from memory.pieces((path, rg), lo, hi, read_slices)
            continue
        at = 0
        for arrays in read_slices(path, rg):
            n = len(next(iter(arrays.values()))) if arrays else 0
            first, last = max(lo, at), min(hi, at + n)
            if first < last:
                yield Piece({c: a[first - at:last - at] for c, a in arrays.items()}, last - first, None)
            at += n
            if at >= hi:
                break


def in_order(pieces: Iterator[Piece], batch_size: int, cols: Sequence[str]) -> Iterator[Dict[str, np.ndarray]]:
    """Batches in the pieces' row order: slices, except a batch that spans two pieces."""
    carry: Optional[Dict[str, np.ndarray]] = None
    for piece in pieces:
        arrays, n = piece.arrays, piece.rows
        if carry is not None:
            have = len(carry[cols[0]])
            take = min(batch_size - have, n)
            carry = {c: np.concatenate([carry[c], arrays[c][:take]]) for c in cols}
            arrays = {c: a[take:] for c, a in arrays.items()}
            n -= take
            if have + take < batch_size:
                continue
            yield carry
            carry = None
        full = n - n % batch_size
        for start in range(0, full, batch_size):
            yield {c: a[start:start + batch_size] for c, a in arrays.items()}
        if full < n:
            carry = {c: a[full:] for c, a in arrays.items()}
    if carry is not None:
        yield carry


def window_sizes(first: int, cap: int) -> Iterator[int]:
    """Rows of each shuffle window: ``first`` (a slice: the first batch waits for it alone), then
    ``cap`` each (the rank's share, or what memory allows), decoded while the first one trains.

    >>> import itertools; list(itertools.islice(window_sizes(100, 500), 3))
    [100, 500, 500]
    """
    yield max(1, min(first, cap))
    while True:
        yield cap


def _split(piece: Piece, rows: int) -> Tuple[Piece, Optional[Piece]]:
    """The piece's first ``rows`` rows, and the rest (None when nothing is left)."""
    if rows >= piece.rows:
        return piece, None
    rest_start = None if piece.start is None else piece.start + rows
    return (Piece({c: a[:rows] for c, a in piece.arrays.items()}, rows, piece.start),
            Piece({c: a[rows:] for c, a in piece.arrays.items()}, piece.rows - rows, rest_start))


def _windows(pieces: Iterator[Piece], sizes: Iterator[int]) -> Iterator[Tuple[List[Piece], bool]]:
    """The pieces regrouped into windows of exactly the ``sizes`` rows (the last may be smaller),
    each with whether it is the last: windows depend on the row order alone, not on how the
    rows were sliced (decoded now, or held in memory)."""
    window: List[Piece] = []
    rows, wanted = 0, next(sizes)
    done: Optional[List[Piece]] = None
    for piece in pieces:
        rest: Optional[Piece] = piece
        while rest is not None:
            if done is not None:  # more rows follow the window completed before: it was not the last
                yield done, False
                done = None
            head, rest = _split(rest, wanted - rows)
            window.append(head)
            rows += head.rows
            if rows == wanted:
                done, window, rows, wanted = window, [], 0, next(sizes)
    if done is not None:
        yield done, True
    elif window:
        yield window, True


def shuffled(pieces: Iterator[Piece], batch_size: int, cols: Sequence[str], window_rows: int,
             rng: np.random.Generator, memory: Optional[SplitMemory],
             first_window: Optional[int] = None) -> Iterator[Dict[str, np.ndarray]]:
    """Batches of rows drawn at random from windows of consecutive rows: the first of
    ``first_window`` rows (default ``window_rows``; one slice decoded is enough to start), the
    next ones of ``window_rows``; the fewer than ``batch_size`` rows a window leaves join the next one. Rows inside a
    batch keep their order in the window (locality);
    which rows form a batch is random. With the split in memory the batches are the same,
    gathered from the split's arrays (so a resumed fit, its memory cold, draws what the
    interrupted one drew)."""
    windows = _windows(pieces, window_sizes(first_window or window_rows, window_rows))
    if memory is not None:
        yield from _shuffled_in_memory(windows, batch_size, cols, rng, memory)
        return
    carry: List[Piece] = []
    for window, last in windows:
        window = carry + window
        rows = sum(p.rows for p in window)
        perm = rng.permutation(rows)
        full = rows if last else rows - rows % batch_size
        bounds = np.cumsum([0] + [p.rows for p in window])
        for start in range(0, full, batch_size):
            yield _gather(window, bounds, np.sort(perm[start:start + batch_size]), cols)
        carry = [Piece(_gather(window, bounds, np.sort(perm[full:]), cols), rows - full, None)] if full < rows else []


def _shuffled_in_memory(windows: Iterator[Tuple[List[Piece], bool]], batch_size: int, cols: Sequence[str],
                        rng: np.random.Generator, memory: SplitMemory) -> Iterator[Dict[str, np.ndarray]]:
    """shuffled() over row numbers of the split's arrays: one gather per column and batch."""
    carry = np.zeros(0, dtype=np.int64)
    for window, last in windows:
        where = np.concatenate([carry] + [_positions(p) for p in window])
        rows = len(where)
        perm = rng.permutation(rows)
        full = rows if last else rows - rows % batch_size
        for start in range(0, full, batch_size):
            idx = where[np.sort(perm[start:start + batch_size])]  # the same rows, in the same order, as _gather
            yield {c: memory.arrays[c][idx] for c in cols}
        carry = where[np.sort(perm[full:])] if full < rows else np.zeros(0, dtype=np.int64)


def _positions(piece: Piece) -> np.ndarray:
    """Where a piece held in memory sits in the split's arrays."""
    assert piece.start is not None, "a piece of a split held in memory knows its place"
    return np.arange(piece.start, piece.start + piece.rows)


def _gather(window: List[Piece], bounds: np.ndarray, rows: np.ndarray, cols: Sequence[str]) -> Dict[str, np.ndarray]:
    """The window's ``rows`` (sorted indices over its pieces, in order) as one array per column."""
    if len(window) == 1:
        return {c: window[0].arrays[c][rows] for c in cols}
    cuts = list(np.searchsorted(rows, bounds[1:-1])) + [len(rows)]
    out = {}
    for c in cols:
        first = window[0].arrays[c]
        dest = np.empty((len(rows),) + first.shape[1:], dtype=first.dtype)
        start = 0
        for j, end in enumerate(cuts):
            if end > start:
                np.take(window[j].arrays[c], rows[start:end] - bounds[j], axis=0, out=dest[start:end])
            start = end
        out[c] = dest
    return out


def as_torch(batch: Dict[str, Any]) -> Dict[str, Any]:
    """Numeric numpy arrays as torch tensors (zero-copy); bytes and tensors stay as they are.

    Arrays read from Arrow are read-only; torch warns about those (_READ_ONLY_WARNING)."""
    import torch

    out = {}
    for name, value in batch.items():
        if isinstance(value, np.ndarray) and value.dtype != object:
            value = torch.from_numpy(value)
        out[name] = value
    return out


# The tensors as_torch makes only feed forward() and go with their batch, so they share the
# read-only Arrow memory rather than copy it; torch's warning about that is silenced for this
# module alone (a filter set once: warnings.catch_warnings per batch is not thread-safe).
_READ_ONLY_WARNING = "The given NumPy array is not writable"
warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING, category=UserWarning, module=__name__)


def prefetched(source: Iterator[Any], depth: int) -> Iterator[Any]:
    """Run ``source`` in a background thread, ``depth`` items ahead (decoding releases the GIL)."""
    q: "queue.Queue" = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for item in source:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            q.put(exc)

    thread = threading.Thread(target=produce, name="sparkring-prefetch", daemon=True)
    thread.start()

    def consume():
        try:
            while True:
                item = q.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()

    return consume()
