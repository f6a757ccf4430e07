"""Dataset: a picklable handle to prepared Parquet, read as balanced per-rank torch batches."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import reader, reuse
from .petastorm_reader import check_reader, petastorm_row_groups
from .reader import (
    RowSelector,
    arrow_row_groups,
    as_torch,
    decoded_pieces,
    in_order,
    plan_rows,
    prefetched,
    row_bytes,
    share,
    shuffled,
    slice_rows,
    source_row_groups,
    validation_rows,
    whole_groups,
)
from .spec import FeatureSpec
from .split_memory import SharedBuffer, SplitLayout, SplitMemory, layout_columns
from .transform import transformed

METADATA_FILE = "_sparkring_metadata.json"
# metadata["layout"] of a Dataset over the DataFrame's own Parquet files (in_place.py): paths
# are the files' local paths, columns keep the layout Spark wrote
IN_PLACE = "in_place"
__all__ = ["Dataset", "ColumnValues", "METADATA_FILE", "as_torch", "plan_rows"]


def _check_batches(batch_size: int, rank: int, size: int, split: str, reader: str) -> None:
    """Dataset.batches' arguments, refused with the value and what is allowed."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: it must be at least 1")
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank} is outside 0..size-1 (size={size})")
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}: use 'train' or 'val'")
    check_reader(reader)


@dataclass(frozen=True)
class ColumnValues:
    """A numeric scalar column's smallest value (None: no non-null value) and how many of its
    values are not whole numbers (None: not counted; data read in place is checked as ranks
    read it).

    >>> ColumnValues(minimum=0.0, non_integral=0).non_integral
    0
    """

    minimum: Optional[float]
    non_integral: Optional[int]


# the schemes of files read in place: the local disk, and S3 as Spark's hadoop-aws (s3a) names it
IN_PLACE_SCHEMES = ("file", "s3a", "s3")


def open_parquet(path: str, storage_options: Optional[Dict[str, Any]] = None):
    """A ParquetFile of a local path, memory-mapped (decoding reads the page cache, no extra
    copy), or of a file read in place at an ``s3a://``/``s3://`` URL through s3fs with ``storage_options`` (the
    Store's, when
    the Store is on S3 too: else the AWS environment's credentials)."""
    import pyarrow.parquet as pq

    if "://" not in path:
        return pq.ParquetFile(path, memory_map=True)
    import fsspec

    fs, inner = fsspec.core.url_to_fs("s3://" + path.split("://", 1)[1], **(storage_options or {}))
    return pq.ParquetFile(fs.open(inner, "rb"))


def s3_options(store: Any) -> Dict[str, Any]:
    """How files on S3 read in place are reached: with the Store's options when the Store is on
    S3 too (the same endpoint and credentials), else as s3fs finds them (the AWS environment)."""
    return dict(store.storage_options) if store.url.startswith(("s3://", "s3a://")) else {}


class Dataset:
    """Prepared training (and validation) data; small and picklable, so it travels to ranks.

    >>> ds = prepare(df, store, columns=["features", "label"])  # doctest: +SKIP
    >>> for batch in ds.batches(batch_size=64, rank=sr.rank(), size=sr.size(), epoch=0):
    ...     x, y = batch["features"], batch["label"]  # doctest: +SKIP
    """

    def __init__(self, store, data_dir: str, metadata: Dict[str, Any]):
        self.store = store
        self.data_dir = data_dir
        self.metadata = metadata
        self.spec = FeatureSpec.from_dict(metadata["spec"])
        self._memory: Dict[Tuple[str, Tuple[str, ...]], SplitMemory] = {}

    def __getstate__(self):
        return {"store": self.store, "data_dir": self.data_dir, "metadata": self.metadata}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.spec = FeatureSpec.from_dict(self.metadata["spec"])
        self._memory = {}

    def __repr__(self):
        return (f"Dataset({self.data_dir!r}, train={self.num_rows('train')} rows, "
                f"val={self.num_rows('val')} rows, columns={list(self.columns)})")

    @property
    def columns(self) -> List[str]:
        """The materialized columns' names."""
        return [c.name for c in self.spec.columns]

    @property
    def shapes(self) -> Dict[str, List[int]]:
        """Each column's shape per row, by name."""
        return self.spec.shapes

    def num_rows(self, split: str = "train") -> int:
        """How many rows the split ``split`` holds ('train' or 'val')."""
        return sum(f["rows"] for f in self.metadata["splits"].get(split, []))

    def num_batches(self, batch_size: int, size: int, split: str = "train", drop_last: bool = True,
                    rank: int = 0) -> int:
        """Batches ``rank`` gets per epoch (the same on every rank when drop_last)."""
        _, count = plan_rows(self.num_rows(split), batch_size, rank, size, drop_last)
        return count // batch_size if drop_last else -(-count // batch_size)

    def values(self, column: str) -> Optional[ColumnValues]:
        """What prepare saw of a numeric scalar column's values (both splits); None for other
        columns, or data prepared before prepare recorded it.

        >>> ds.values("label")  # doctest: +SKIP
        ColumnValues(minimum=0.0, non_integral=0)
        """
        seen = self.metadata.get("values", {}).get(column)
        if seen is None:
            return None
        counted = seen["non_integral"]
        return ColumnValues(minimum=seen["min"], non_integral=None if counted is None else int(counted))

    def exists(self) -> bool:
        """Whether the data is materialized in the store (its metadata is written last)."""
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
                workers: int = 0, reader: str = "arrow") -> Iterator[Dict[str, Any]]:
        """Yield ``rank``'s batches of one epoch as dicts of torch tensors.

        Rows, not files, are split between ranks: the epoch's row order (row groups
        permuted by ``(seed, epoch)`` when ``shuffle``) is cut into ``size`` equal
        contiguous shares. With ``drop_last`` every rank gets exactly
        ``rows // (size * batch_size)`` full batches; the fewer than
        ``size * batch_size`` rows at the end of that epoch's order are left out (other
        rows each epoch when shuffling). Without ``drop_last`` every row is read exactly
        once across ranks, shares differ by at most one row and last batches may be short
        (use this for validation).

        Rows are shuffled inside windows of ``shuffle_buffer`` rows; by default the first
        window is one slice (about 8 MB decoded: the first batch waits for that alone, not for
        a whole row group), the next ones the rank's whole share of the epoch when the store is
        local and the share decodes to at most 1 GiB, else 16 batches (at least one row group),
        on top of the random row-group order; a row moves 0.78 as far as in a full shuffle of
        one 250k-row group (a test). Rows inside one batch come in storage order (which rows
        form a batch is random). The windows depend on the row order alone: the same batches
        whether the split is held in memory or decoded now (a resumed fit's memory is cold).

        A background thread decodes ``prefetch`` slices ahead, row group after row group. A split that
        decodes to at most 1 GiB (reader.MEMORY_BYTES, per process) stays in memory for the next epochs
        (``cache=None``, the default; ``True`` keeps it whatever its size, ``False`` never).
        Unshuffled batches are views of those arrays: copy before modifying one in place.

        Numeric columns arrive as torch tensors, binary columns as numpy arrays of ``bytes``.
        ``transform(batch) -> dict`` (see :mod:`sparkring.data.transform`) gets numpy arrays
        and runs before the conversion, in ``workers`` forked processes when > 0.

        ``reader="petastorm"`` reads the row groups through petastorm's ``make_batch_reader``
        instead of pyarrow: the same rows, order and batches (needs petastorm: Spark 3.5 only).

        >>> next(iter(ds.batches(batch_size=2, rank=0, size=2)))["label"]  # doctest: +SKIP
        tensor([1., 0.], dtype=torch.float64)
        """
        _check_batches(batch_size, rank, size, split, reader)
        cols = list(columns) if columns is not None else list(self.columns)
        units = self._units(split)
        if shuffle:
            order = np.random.default_rng([seed, epoch]).permutation(len(units))
            units = [units[i] for i in order]
        first, count = plan_rows(sum(u[2] for u in units), batch_size, rank, size, drop_last)
        if count == 0:
            return iter(())
        memory = self._memory_for(split, cols, cache)
        pieces = decoded_pieces(self._row_groups(reader, split, cols), share(units, first, count), memory)
        pieces = prefetched(pieces, prefetch) if prefetch > 0 else pieces
        if shuffle:
            rng = np.random.default_rng([seed, epoch, rank, 7919])
            out = self._shuffled(pieces, batch_size, cols, rng, memory, rows=count, units=units, window=shuffle_buffer)
        else:
            out = in_order(pieces, batch_size, cols)
        if transform is not None:
            out = transformed(out, transform, workers)
        return (as_torch(b) for b in out)

    def _shuffled(self, pieces, batch_size: int, cols: List[str], rng, memory, *, rows: int, units,
                  window: Optional[int]):
        """Batches shuffled in windows: ``window`` rows, or by default a first window of one slice (the first
        batch waits for that alone) and wider ones after it (see batches)."""
        first_window = None if window else max(batch_size, slice_rows(self.spec, cols))
        window = window or self._window_rows(rows, batch_size, units, cols)
        return shuffled(pieces, batch_size, cols, window, rng, memory, first_window=first_window)

    def global_batches(self, global_batch: int, rank: int, size: int, seed: int = 0, epoch: int = 0,
                       start_step: int = 0, steps: Optional[int] = None, shuffle: bool = True,
                       columns: Optional[Sequence[str]] = None,
                       transform: Optional[Callable] = None) -> Iterator[Dict[str, Any]]:
        """Yield ``rank``'s part of each of the epoch's global batches, from ``start_step`` on.

        The epoch's row order (a permutation of the training rows drawn from ``(seed, epoch)``
        when ``shuffle``) is cut into global batches of ``global_batch`` rows; of ``size`` ranks,
        rank r takes rows ``r*G//size`` to ``(r+1)*G//size`` of each. So the sequence of global
        batches depends on (seed, epoch) only, not on how many ranks share it, and any slice of
        any batch can be served again (a resumed or resized run). Every rank holds the split
        decoded in memory (it reads rows from everywhere in the epoch's order).

        >>> next(iter(ds.global_batches(96, rank=1, size=2, epoch=0)))["label"].shape  # doctest: +SKIP
        torch.Size([48])
        """
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} is outside 0..size-1 (size={size})")
        cols = list(columns) if columns is not None else list(self.columns)
        memory = self._memory_for("train", cols, cache=True)
        assert memory is not None
        # decoded once per process (per host where the ranks share it); later epochs read the memory
        memory.fill_every(self._row_groups("arrow", "train", cols))
        total = memory.total // global_batch
        last = total if steps is None else min(total, start_step + steps)
        order = (np.random.default_rng([seed, epoch, 104_729]).permutation(memory.total) if shuffle
                 else np.arange(memory.total))
        lo, hi = rank * global_batch // size, (rank + 1) * global_batch // size
        out: Iterator[Dict[str, Any]] = (
            {c: np.take(a, np.sort(order[j * global_batch + lo:j * global_batch + hi]), axis=0)
             for c, a in memory.arrays.items()} for j in range(start_step, last))
        if transform is not None:
            out = transformed(out, transform, 0)
        return (as_torch(b) for b in out)

    @property
    def in_place(self) -> bool:
        """Whether this reads the DataFrame's own Parquet files (nothing was prepared)."""
        return self.metadata.get("layout") == IN_PLACE

    def _split_rows(self, split: str) -> Optional[RowSelector]:
        """Data read in place with a validation fraction: the split's rows of each row group
        (every file is listed in the train split, in the order in_place drew them)."""
        fraction = self.metadata.get("validation")
        if fraction is None:
            return None
        index = {f["path"]: i for i, f in enumerate(self.metadata["splits"]["train"])}
        seed, val = self.metadata["seed"] or 0, split == "val"
        return lambda path, rg, rows: validation_rows(seed, index[path], rg, rows, fraction) == val

    def _row_groups(self, reader: str, split: str, cols: List[str]):
        if self.in_place:
            if reader != "arrow":
                raise ValueError(f"reader={reader!r}: data read in place is read with reader='arrow'")
            return source_row_groups(self._open, self.spec, cols, self.metadata.get("integral", ()),
                                     self._split_rows(split))
        if reader == "arrow":
            return arrow_row_groups(self._open, self.spec, cols)
        counts = {f["path"]: len(f["row_groups"]) for f in self.metadata["splits"].get(split, [])}
        return whole_groups(petastorm_row_groups(self._url, counts, self.spec, cols, self.store.storage_options))

    def _url(self, path: str) -> str:
        full = f"{self.data_dir}/{path}"
        local = self.store.local_path(full)
        if local is not None:
            return f"file://{local}"
        return f"{self.store.url.split('://', 1)[0]}://{full}"

    def _open(self, path: str):
        import pyarrow.parquet as pq

        if self.in_place:  # the DataFrame's own files: a local path or an S3 URL
            return open_parquet(path, s3_options(self.store))
        full = f"{self.data_dir}/{path}"
        local = self.store.local_path(full)
        return open_parquet(local) if local is not None else pq.ParquetFile(self.store.fs.open_input_file(full))

    def memory_layouts(self, splits: Sequence[str], cache: Optional[bool] = None) -> List[Optional[SplitLayout]]:
        """Where each split's decoded rows (every column) would sit in one buffer, for the splits
        this process would hold in memory (``cache`` as in batches: None holds what fits in
        reader.MEMORY_BYTES, in this order) when every column's row shape is known before
        decoding; None for the others.

        >>> ds.memory_layouts(["train", "val"])[0].nbytes  # doctest: +SKIP
        264000128
        """
        columns = layout_columns(self.spec, self.columns)
        held = sum(m.total * row_bytes(self.spec, list(k[1])) for k, m in self._memory.items())
        out: List[Optional[SplitLayout]] = []
        for split in splits:
            units = self._units(split)
            wanted = sum(u[2] for u in units) * row_bytes(self.spec, self.columns)
            too_large = cache is None and held + wanted > reader.MEMORY_BYTES
            if columns is None or not units or cache is False or too_large:
                out.append(None)
                continue
            held += wanted
            out.append(SplitLayout.of(sum(u[2] for u in units), len(units), columns))
        return out

    def share_memory(self, split: str, buffer: SharedBuffer) -> None:
        """Hold ``split``'s decoded rows (every column) in ``buffer``, a segment laid out by
        memory_layouts that this host's other ranks map too: a row group one of them decodes
        serves all (see sparkring.data.split_memory).

        >>> ds.share_memory("train", SharedBuffer(segment.mm, segment.fd, layout))  # doctest: +SKIP
        """
        self._memory[(split, tuple(self.columns))] = SplitMemory(self._units(split), shared=buffer)

    def _memory_for(self, split: str, cols: List[str], cache: Optional[bool]) -> Optional[SplitMemory]:
        """The split's in-memory arrays for ``cols`` (made on first use), or None."""
        if cache is False:
            return None
        key = (split, tuple(cols))
        memory = self._memory.get(key)
        if memory is None:
            units = self._units(split)
            held = sum(m.total * row_bytes(self.spec, list(k[1])) for k, m in self._memory.items())
            wanted = sum(u[2] for u in units) * row_bytes(self.spec, cols)
            if cache is None and held + wanted > reader.MEMORY_BYTES:
                return None
            memory = self._memory[key] = SplitMemory(units)
        return memory

    def _window_rows(self, count: int, batch_size: int, units, cols) -> int:
        """Rows shuffled together: the rank's whole share when it is local and takes at most
        MEMORY_BYTES decoded, else 16 batches (at least one row group)."""
        local = self.in_place or self.store.local_path(self.data_dir) is not None
        if local and count * row_bytes(self.spec, cols) <= reader.MEMORY_BYTES:
            return count
        return max(16 * batch_size, max(u[2] for u in units))
