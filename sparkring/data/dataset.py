"""Dataset: a picklable handle to prepared Parquet, read as balanced per-rank torch batches."""
from __future__ import annotations

import queue
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import reuse
from .spec import BYTES, FeatureSpec, to_numpy
from .transform import transformed

METADATA_FILE = "_sparkring_metadata.json"
# Batches are views of Arrow buffers, which numpy flags read-only; torch warns on each one
# (a catch_warnings per batch costs as much as the batch itself). Only that message is muted.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


def plan_rows(total: int, batch_size: int, rank: int, size: int, drop_last: bool) -> Tuple[int, int]:
    """(first row, row count) of ``rank``'s share of one epoch's row order."""
    if drop_last:
        per_rank = (total // (size * batch_size)) * batch_size
        return rank * per_rank, per_rank
    base, extra = divmod(total, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


class Dataset:
    """Prepared training (and validation) data; small and picklable, so it travels to ranks.

    >>> ds = prepare(df, store, columns=["features", "label"])
    >>> for batch in ds.batches(batch_size=64, rank=sr.rank(), size=sr.size(), epoch=0):
    ...     x, y = batch["features"], batch["label"]  # doctest: +SKIP
    """

    def __init__(self, store, data_dir: str, metadata: Dict[str, Any]):
        self.store = store
        self.data_dir = data_dir
        self.metadata = metadata
        self.spec = FeatureSpec.from_dict(metadata["spec"])
        self._decoded: Dict[Tuple[str, int], Dict[str, np.ndarray]] = {}
        self._decoded_bytes = 0

    def __getstate__(self):
        return {"store": self.store, "data_dir": self.data_dir, "metadata": self.metadata}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.spec = FeatureSpec.from_dict(self.metadata["spec"])
        self._decoded = {}
        self._decoded_bytes = 0

    def __repr__(self):
        return (f"Dataset({self.data_dir!r}, train={self.num_rows('train')} rows, "
                f"val={self.num_rows('val')} rows, columns={list(self.columns)})")

    @property
    def columns(self) -> List[str]:
        return [c.name for c in self.spec.columns]

    @property
    def shapes(self) -> Dict[str, List[int]]:
        return self.spec.shapes

    def num_rows(self, split: str = "train") -> int:
        return sum(f["rows"] for f in self.metadata["splits"].get(split, []))

    def num_batches(self, batch_size: int, size: int, split: str = "train", drop_last: bool = True,
                    rank: int = 0) -> int:
        """Batches ``rank`` gets per epoch (the same on every rank when drop_last)."""
        _, count = plan_rows(self.num_rows(split), batch_size, rank, size, drop_last)
        return count // batch_size if drop_last else -(-count // batch_size)

    def exists(self) -> bool:
        return self.store.exists(f"{self.data_dir}/{METADATA_FILE}")

    def delete(self) -> None:
        """Remove the prepared files from the store.

        >>> ds.delete()  # doctest: +SKIP
        """
        self.store.delete(self.data_dir)
        reuse.forget(self.data_dir)

    # -- reading ----------------------------------------------------------------------
    def _units(self, split: str) -> List[Tuple[str, int, int]]:
        return [(f["path"], i, n) for f in self.metadata["splits"].get(split, [])
                for i, n in enumerate(f["row_groups"])]

    def batches(self, batch_size: int, rank: int = 0, size: int = 1, shuffle: bool = True, seed: int = 0,
                epoch: int = 0, drop_last: bool = True, split: str = "train", prefetch: int = 2,
                cache: Optional[bool] = None, shuffle_buffer: Optional[int] = None,
                columns: Optional[Sequence[str]] = None, transform: Optional[Callable] = None,
                workers: int = 0) -> Iterator[Dict[str, Any]]:
        """Yield ``rank``'s batches of one epoch as dicts of torch tensors.

        Rows, not files, are split between ranks: the epoch's row order (row groups
        permuted by ``(seed, epoch)`` when ``shuffle``) is cut into ``size`` equal
        contiguous shares. With ``drop_last`` every rank gets exactly
        ``rows // (size * batch_size)`` full batches; the fewer than
        ``size * batch_size`` rows at the end of that epoch's order are left out (other
        rows each epoch when shuffling). Without ``drop_last`` every row is read exactly
        once across ranks, shares differ by at most one row and last batches may be short
        (use this for validation). Rows are shuffled inside a window of ``shuffle_buffer``
        rows; by default the rank's whole share of the epoch when the store is local and the
        share decodes to at most 1 GiB (a full shuffle of the share, gathered at memory
        speed), else 16 batches (at least one row group) on top of the random row-group
        order. Rows inside one batch come in storage order (which rows form a batch is random).

        A background thread decodes ``prefetch`` groups of batches (up to 4 MB) ahead. Decoded
        row groups stay in memory for the next epochs (later epochs only gather rows): all of
        them with ``cache=True``, none with ``False``, and by default (None) up to
        MEMORY_BYTES (1 GiB) per process. Batches are views of those arrays: copy before
        modifying one in place.

        Numeric columns arrive as torch tensors, binary columns as numpy arrays of ``bytes``.
        ``transform(batch) -> dict`` (see :mod:`sparkring.data.transform`) gets numpy arrays
        and runs before the conversion, in ``workers`` forked processes when > 0.

        >>> next(iter(ds.batches(batch_size=2, rank=0, size=2)))["label"]  # doctest: +SKIP
        tensor([1., 0.], dtype=torch.float64)
        """
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: it must be at least 1")
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} is outside 0..size-1 (size={size})")
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}: use 'train' or 'val'")
        cols = list(columns) if columns is not None else list(self.columns)
        source = self._generate(batch_size, rank, size, shuffle, seed, epoch, drop_last, split, cache,
                                shuffle_buffer, cols)
        if prefetch > 0:
            source = _ungrouped(_prefetched(_grouped(source), prefetch))
        if transform is not None:
            source = transformed(source, transform, workers)
        return (as_torch(b) for b in source)

    def _generate(self, batch_size, rank, size, shuffle, seed, epoch, drop_last, split, cache,
                  shuffle_buffer, cols) -> Iterator[Dict[str, Any]]:
        import pyarrow.parquet as pq

        units = self._units(split)
        if shuffle:
            order = np.random.default_rng([seed, epoch]).permutation(len(units))
            units = [units[i] for i in order]
        total = sum(u[2] for u in units)
        first, count = plan_rows(total, batch_size, rank, size, drop_last)
        if count == 0:
            return
        pieces: List[Tuple[str, int, int, int]] = []  # (path, row group, start, stop)
        offset = 0
        for path, rg, n in units:
            lo, hi = max(first, offset), min(first + count, offset + n)
            if lo < hi:
                pieces.append((path, rg, lo - offset, hi - offset))
            offset += n
        rng = np.random.default_rng([seed, epoch, rank, 7919])
        files: Dict[str, Any] = {}

        def decode(path: str, rg: int) -> Dict[str, np.ndarray]:
            key = (f"{split}/{path}", rg)
            if key in self._decoded:
                return self._decoded[key]
            if path not in files:
                full = f"{self.data_dir}/{path}"
                local = self.store.local_path(full)
                # local files are memory-mapped: decoding reads the page cache, no extra copy
                files[path] = (pq.ParquetFile(local, memory_map=True) if local is not None
                               else pq.ParquetFile(self.store.fs.open_input_file(full)))
            table = files[path].read_row_group(rg, columns=cols)
            arrays = {c: to_numpy(table.column(c), self.spec.column(c)) for c in cols}
            nbytes = sum(a.nbytes for a in arrays.values())
            if cache or (cache is None and self._decoded_bytes + nbytes <= MEMORY_BYTES):
                self._decoded[key] = arrays
                self._decoded_bytes += nbytes
            return arrays

        carry: Optional[Dict[str, np.ndarray]] = None

        def emit(arrays: Dict[str, np.ndarray], final: bool):
            nonlocal carry
            n = len(next(iter(arrays.values())))
            if carry is not None:
                # top the carried rows up to one batch; copy only those, slice the rest
                have = len(next(iter(carry.values())))
                take = min(batch_size - have, n)
                carry = {c: np.concatenate([carry[c], arrays[c][:take]]) for c in cols}
                arrays = {c: a[take:] for c, a in arrays.items()}
                n -= take
                if have + take == batch_size:
                    yield carry
                    carry = None
                elif final:
                    yield carry
                    carry = None
                    return
                else:
                    return
            full = n - n % batch_size
            for start in range(0, full, batch_size):
                yield {c: a[start:start + batch_size] for c, a in arrays.items()}
            if full < n:
                rest = {c: a[full:] for c, a in arrays.items()}
                if final:
                    yield rest
                else:
                    carry = rest

        if not shuffle:
            for i, (path, rg, lo, hi) in enumerate(pieces):
                arrays = decode(path, rg)
                yield from emit({c: a[lo:hi] for c, a in arrays.items()}, final=i == len(pieces) - 1)
            return

        # Shuffled: a window of pieces (views of decoded row groups) is permuted as a whole and
        # each batch gathers its rows straight from the pieces (one copy, indices sorted for
        # locality); the fewer than batch_size rows left over join the next window.
        target = shuffle_buffer or self._window_rows(count, batch_size, units, cols)
        window: List[Dict[str, np.ndarray]] = []
        rows = 0
        for i, (path, rg, lo, hi) in enumerate(pieces):
            arrays = decode(path, rg)
            window.append({c: a[lo:hi] for c, a in arrays.items()})
            rows += hi - lo
            last = i == len(pieces) - 1
            if rows < target and not last:
                continue
            perm = rng.permutation(rows)
            full = rows if last else rows - rows % batch_size
            bounds = np.cumsum([0] + [len(w[cols[0]]) for w in window])
            for start in range(0, full, batch_size):
                yield _gather(window, bounds, np.sort(perm[start:start + batch_size]), cols)
            if full < rows:
                window = [_gather(window, bounds, np.sort(perm[full:]), cols)]
                rows -= full
            else:
                window, rows = [], 0

    def _window_rows(self, count: int, batch_size: int, units, cols) -> int:
        """Rows shuffled together: the rank's whole share when it is local and takes at most
        MEMORY_BYTES decoded, else 16 batches (at least one row group)."""
        if self.store.local_path(self.data_dir) is not None:
            row_bytes = 0
            for c in cols:
                col = self.spec.column(c)
                row_bytes += 4096 if col.kind == BYTES else col.width() * np.dtype(col.dtype).itemsize
            if count * row_bytes <= MEMORY_BYTES:
                return count
        return max(16 * batch_size, max(u[2] for u in units))


def _gather(window: List[Dict[str, np.ndarray]], bounds: np.ndarray, rows: np.ndarray,
            cols: List[str]) -> Dict[str, np.ndarray]:
    """The window's ``rows`` (sorted indices over its pieces, in order) as one array per column."""
    if len(window) == 1:
        return {c: window[0][c][rows] for c in cols}
    cuts = list(np.searchsorted(rows, bounds[1:-1])) + [len(rows)]
    out = {}
    for c in cols:
        first = window[0][c]
        dest = np.empty((len(rows),) + first.shape[1:], dtype=first.dtype)
        start = 0
        for j, end in enumerate(cuts):
            if end > start:
                np.take(window[j][c], rows[start:end] - bounds[j], axis=0, out=dest[start:end])
            start = end
        out[c] = dest
    return out


def as_torch(batch: Dict[str, Any]) -> Dict[str, Any]:
    """Numeric numpy arrays as torch tensors (zero-copy); bytes and tensors stay as they are."""
    import torch

    out = {}
    for name, value in batch.items():
        if isinstance(value, np.ndarray) and value.dtype != object:
            value = torch.from_numpy(value)
        out[name] = value
    return out


GROUP_BYTES = 4 << 20
# What one reader (one rank) keeps decoded in memory: the cache of row groups for later
# epochs, and the largest share shuffled as one window.
MEMORY_BYTES = 1 << 30
GROUP_BATCHES = 16


def _grouped(source: Iterator[Dict[str, Any]]) -> Iterator[List[Dict[str, Any]]]:
    """Batches in lists of up to GROUP_BATCHES or GROUP_BYTES, so the prefetch thread hands
    over once per group: a hand-over costs tens of microseconds, as much as a small batch."""
    group: List[Dict[str, Any]] = []
    size = 0
    for batch in source:
        group.append(batch)
        size += sum(getattr(v, "nbytes", 0) for v in batch.values())
        if len(group) >= GROUP_BATCHES or size >= GROUP_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group


def _ungrouped(groups: Iterator[List[Dict[str, Any]]]) -> Iterator[Dict[str, Any]]:
    for group in groups:
        yield from group


def _prefetched(source: Iterator[Dict[str, Any]], depth: int) -> Iterator[Dict[str, Any]]:
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
