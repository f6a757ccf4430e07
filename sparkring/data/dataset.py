"""Dataset: a picklable handle to prepared Parquet, read as balanced per-rank torch batches."""
from __future__ import annotations

import queue
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import reuse
from .spec import FeatureSpec, to_numpy
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

    def __getstate__(self):
        return {"store": self.store, "data_dir": self.data_dir, "metadata": self.metadata}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.spec = FeatureSpec.from_dict(self.metadata["spec"])
        self._decoded = {}

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
                cache: bool = False, shuffle_buffer: Optional[int] = None,
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
        (use this for validation). Rows are shuffled inside a buffer of
        ``shuffle_buffer`` rows (default: 16 batches, at least one row group).

        A background thread decodes ``prefetch`` groups of batches (up to 4 MB) ahead; ``cache=True`` keeps
        decoded row groups in memory for the next epochs.

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
        import torch

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
        buffer_rows = shuffle_buffer or max(16 * batch_size, max(u[2] for u in units))
        rng = np.random.default_rng([seed, epoch, rank, 7919])
        files: Dict[str, Any] = {}

        def decode(path: str, rg: int) -> Dict[str, np.ndarray]:
            key = (f"{split}/{path}", rg)
            if cache and key in self._decoded:
                return self._decoded[key]
            if path not in files:
                full = f"{self.data_dir}/{path}"
                local = self.store.local_path(full)
                # local files are memory-mapped: decoding reads the page cache, no extra copy
                files[path] = (pq.ParquetFile(local, memory_map=True) if local is not None
                               else pq.ParquetFile(self.store.fs.open_input_file(full)))
            table = files[path].read_row_group(rg, columns=cols)
            arrays = {c: to_numpy(table.column(c), self.spec.column(c)) for c in cols}
            if cache:
                self._decoded[key] = arrays
            return arrays

        def to_torch(arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
            return arrays  # numpy until after the transform: see as_torch

        window: List[Dict[str, np.ndarray]] = []
        window_rows = 0
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
                    yield to_torch(carry)
                    carry = None
                elif final:
                    yield to_torch(carry)
                    carry = None
                    return
                else:
                    return
            full = n - n % batch_size
            for start in range(0, full, batch_size):
                yield to_torch({c: a[start:start + batch_size] for c, a in arrays.items()})
            if full < n:
                rest = {c: a[full:] for c, a in arrays.items()}
                if final:
                    yield to_torch(rest)
                else:
                    carry = rest

        for i, (path, rg, lo, hi) in enumerate(pieces):
            arrays = decode(path, rg)
            sliced = {c: a[lo:hi] for c, a in arrays.items()}
            last = i == len(pieces) - 1
            if not shuffle:
                yield from emit(sliced, final=last)
                continue
            window.append(sliced)
            window_rows += hi - lo
            if window_rows >= buffer_rows or last:
                merged = {c: np.concatenate([w[c] for w in window]) if len(window) > 1 else window[0][c]
                          for c in cols}
                perm = rng.permutation(window_rows)
                yield from emit({c: a[perm] for c, a in merged.items()}, final=last)
                window, window_rows = [], 0


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
