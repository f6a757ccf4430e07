"""DataFrame -> Parquet in the Store: check and encode the columns a FeatureSpec names in
one pass on the executors, then record the measured shapes, the spec and what the numeric
scalars hold (smallest value, non-integral count: the class-label check) in the metadata."""
from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Dict, List, Optional, Sequence, Union, cast

import numpy as np

from . import reuse as reuse_cache
from .dataset import METADATA_FILE, Dataset
from .file_copy import CopyUnit, copy_units, unit_batches
from .in_place import ScannedFiles, read_in_place, scan_facts
from .spec import SCALAR, TENSOR, ColumnSpec, DataError, FeatureSpec, tensor_profile, to_stored
from .store import Store
from .unischema import petastorm_codecs

log = logging.getLogger(__name__)

VAL_COLUMN = "__sparkring_val"
TARGET_ROW_GROUP_BYTES = 8 * 1024 * 1024


def _numeric_scalar(c: ColumnSpec) -> bool:
    return c.kind == SCALAR and np.dtype(c.dtype).kind in "iuf"


def _observe_values(stats: Dict[str, Any], name: str, arr) -> None:
    """A numeric scalar column's smallest value and its count of non-integral values (what a
    class-index label is checked against, without a pass of its own over the DataFrame)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if len(arr) == arr.null_count:
        return
    low = pc.min(arr).as_py()
    old = stats[f"{name}__min"]
    stats[f"{name}__min"] = low if old is None else min(old, low)
    if pa.types.is_floating(arr.type):
        stats[f"{name}__non_integral"] += int(pc.sum(pc.not_equal(arr, pc.floor(arr))).as_py() or 0)


def _merge_stats(parts: List[Dict[str, Any]], columns: Sequence[ColumnSpec]) -> Dict[str, Any]:
    merged: Dict[str, Any] = {"__rows": sum(p["__rows"] for p in parts)}
    for c in columns:
        merged[f"{c.name}__nulls"] = sum(p[f"{c.name}__nulls"] for p in parts)
        if _numeric_scalar(c):
            lows = [p[f"{c.name}__min"] for p in parts if p[f"{c.name}__min"] is not None]
            merged[f"{c.name}__min"] = min(lows) if lows else None
            merged[f"{c.name}__non_integral"] = sum(p[f"{c.name}__non_integral"] for p in parts)
        if c.kind == TENSOR:
            dims = []
            for level in range(c.levels):
                los = [p[f"{c.name}__dims"][level][0] for p in parts if p[f"{c.name}__dims"][level][0] is not None]
                his = [p[f"{c.name}__dims"][level][1] for p in parts if p[f"{c.name}__dims"][level][1] is not None]
                dims.append((min(los) if los else 0, max(his) if his else 0))
            merged[f"{c.name}__dims"] = dims
            merged[f"{c.name}__null_elems"] = sum(p[f"{c.name}__null_elems"] for p in parts)
    return merged


def _measure(profile: Dict[str, Any], columns: Sequence[ColumnSpec]) -> Dict[str, List[int]]:
    """Each tensor column's row shape; DataError naming the column for nulls and ragged rows."""
    if profile["__rows"] == 0:
        raise DataError("the DataFrame is empty: there is nothing to train on; check upstream filters")
    shapes: Dict[str, List[int]] = {}
    for c in columns:
        nulls = profile[f"{c.name}__nulls"] or 0
        if nulls:
            raise DataError(f"column {c.name!r} has {nulls} null value(s) out of {profile['__rows']} rows: "
                            "fill them (df.fillna / Imputer) or filter them out (df.dropna)")
        if c.kind != TENSOR:
            continue
        what = "vector" if c.vector else "array"
        for level, (lo, hi) in enumerate(profile[f"{c.name}__dims"]):
            where = "" if level == 0 else f" at nesting level {level + 1}"
            if lo != hi:
                raise DataError(f"column {c.name!r} holds {what}s of different lengths ({lo} to {hi}){where}; "
                                "every row must have the same shape: pad or truncate them")
            if lo == 0:
                raise DataError(f"column {c.name!r} holds empty {what}s{where}; they must have at least one "
                                "element")
        if profile.get(f"{c.name}__null_elems"):
            raise DataError(f"column {c.name!r} has {profile[f'{c.name}__null_elems']} array(s) with null "
                            "elements: fill or drop them")
        shapes[c.name] = [int(lo) for lo, _ in profile[f"{c.name}__dims"]]
    return shapes


def _write_partition_fn(store: Store, data_dir: str, columns: List[ColumnSpec]):
    """The function mapInArrow runs on executors: check, encode and write one Parquet file
    per split in the same pass, and report what it saw (rows, nulls, lengths) so that the
    driver validates without a separate scan of the data."""

    def write(batches):
        writer = _PartitionWriter(store, data_dir, columns)
        for batch in batches:
            writer.add(batch)
        yield writer.close()

    return write


class _PartitionWriter:
    """One partition's Parquet files (a train and a val split) and the statistics of its rows."""

    def __init__(self, store: Store, data_dir: str, columns: List[ColumnSpec]):
        from pyspark import TaskContext

        ctx = TaskContext.get()
        self.tag = (f"{ctx.partitionId():05d}-{ctx.attemptNumber()}-{uuid.uuid4().hex[:8]}" if ctx
                    else uuid.uuid4().hex)
        self.store, self.data_dir, self.columns = store, data_dir, columns
        self.writers: Dict[str, Any] = {}
        self.pending: Dict[str, List[Any]] = {"train": [], "val": []}
        self.counts: Dict[str, List[int]] = {"train": [], "val": []}
        self.stats: Dict[str, Any] = {"__rows": 0}
        for c in columns:
            self.stats[f"{c.name}__nulls"] = 0
            if _numeric_scalar(c):
                self.stats.update({f"{c.name}__min": None, f"{c.name}__non_integral": 0})
            if c.kind == TENSOR:
                self.stats.update({f"{c.name}__dims": [(None, None)] * c.levels, f"{c.name}__null_elems": 0})
        self.ok = True
        self.row_group_rows: Optional[int] = None

    def _observe(self, batch) -> bool:
        """Update the stats; False when this batch cannot be written as tensors."""
        ok, stats = True, self.stats
        stats["__rows"] += batch.num_rows
        for c in self.columns:
            arr = batch.column(batch.schema.get_field_index(c.name))
            if arr.null_count:
                stats[f"{c.name}__nulls"] += arr.null_count
                ok = False
            if _numeric_scalar(c):
                _observe_values(stats, c.name, arr)
            if c.kind != TENSOR:
                continue
            dims, bad_rows = tensor_profile(arr, c.levels)
            merged = []
            for (lo, hi), (old_lo, old_hi) in zip(dims, stats[f"{c.name}__dims"]):
                lo = lo if old_lo is None else (old_lo if lo is None else min(old_lo, lo))
                hi = hi if old_hi is None else (old_hi if hi is None else max(old_hi, hi))
                merged.append((lo, hi))
                if lo != hi or lo == 0:
                    ok = False
            stats[f"{c.name}__dims"] = merged
            if bad_rows:
                stats[f"{c.name}__null_elems"] += bad_rows
                ok = False
        return ok

    def _flush(self, split: str, final: bool = False) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        row_group_rows = self.row_group_rows
        assert row_group_rows is not None
        tables = self.pending[split]
        rows = sum(t.num_rows for t in tables)
        if not rows or (rows < row_group_rows and not final):
            return
        table = pa.concat_tables(tables).combine_chunks()
        full = rows if final else rows - rows % row_group_rows
        if split not in self.writers:
            path = f"{self.data_dir}/{split}/part-{self.tag}.parquet"
            self.store.makedirs(f"{self.data_dir}/{split}")
            self.writers[split] = (pq.ParquetWriter(
                self.store.fs.open_output_stream(path), table.schema, compression="NONE",
                use_dictionary=False, write_statistics=False), path)
        writer = self.writers[split][0]
        for start in range(0, full, row_group_rows):
            part = table.slice(start, min(row_group_rows, full - start))
            writer.write_table(part, row_group_size=part.num_rows)
            self.counts[split].append(part.num_rows)
        self.pending[split] = [table.slice(full)] if full < rows else []

    def add(self, batch) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        if batch.num_rows == 0:
            return
        if not self._observe(batch):
            self.ok = False
        if not self.ok:
            return  # keep counting for the error message, write nothing more
        table = pa.Table.from_arrays([to_stored(batch.column(batch.schema.get_field_index(c.name)), c)
                                      for c in self.columns], names=[c.name for c in self.columns])
        if self.row_group_rows is None:
            row_bytes = table.nbytes / max(1, table.num_rows)
            self.row_group_rows = int(max(256, min(1 << 20, TARGET_ROW_GROUP_BYTES // max(1, row_bytes))))
        is_val = batch.column(batch.schema.get_field_index(VAL_COLUMN)).to_numpy(zero_copy_only=False)
        if is_val.any():
            mask = pa.array(is_val)
            self.pending["val"].append(table.filter(mask))
            self.pending["train"].append(table.filter(pc.invert(mask)))
        else:
            self.pending["train"].append(table)
        for split in ("train", "val"):
            self._flush(split)

    def close(self):
        """Finish the files; one record batch naming them, their row groups and the stats."""
        import pyarrow as pa

        if self.ok and self.row_group_rows is not None:
            for split in ("train", "val"):
                self._flush(split, final=True)
        out: Dict[str, List[Any]] = {"split": [], "path": [], "rows": [], "row_groups": [], "stats": []}
        for split, (writer, path) in self.writers.items():
            writer.close()
            out["split"].append(split)
            out["path"].append(path)
            out["rows"].append(sum(self.counts[split]))
            out["row_groups"].append(self.counts[split])
            out["stats"].append(None)
        out["split"].append("stats")
        out["path"].append(None)
        out["rows"].append(self.stats["__rows"])
        out["row_groups"].append([])
        out["stats"].append(json.dumps(self.stats))
        return pa.RecordBatch.from_pydict(out, schema=pa.schema([
            ("split", pa.string()), ("path", pa.string()), ("rows", pa.int64()),
            ("row_groups", pa.list_(pa.int64())), ("stats", pa.string())]))


def _cache_key(df, store: Store, spec: FeatureSpec, validation, seed):
    try:
        plan = df.semanticHash()
    except Exception:  # noqa: BLE001 - no plan hash (Spark Connect variants): no reuse
        return None
    return (plan, df.schema.json(), json.dumps(spec.to_dict(), sort_keys=True), validation, seed, store.url)


def _check_validation(df, validation: Union[None, float, str]) -> Union[None, float, str]:
    if isinstance(validation, str):
        from pyspark.sql.types import BooleanType

        fields = {f.name: f.dataType for f in df.schema.fields}
        if validation not in fields:
            raise DataError(f"validation={validation!r} is not a column of the DataFrame; it has {df.columns}")
        if not isinstance(fields[validation], BooleanType):
            raise DataError(f"validation column {validation!r} has type {fields[validation].simpleString()};"
                            " it must be boolean (True marks validation rows)")
        return validation
    if validation is not None:
        if isinstance(validation, bool) or not 0 < float(validation) < 1:
            raise DataError(f"validation={validation!r}: give a fraction strictly between 0 and 1, "
                            "or the name of a boolean column")
        return float(validation)
    return None


def prepare(df, store: Optional[Store] = None, columns: Optional[Sequence[str]] = None,
            validation: Union[None, float, str] = None, seed: Optional[int] = None,
            run_id: Optional[str] = None, reuse: bool = True, spec: Optional[FeatureSpec] = None,
            in_place: bool = False, integral: Sequence[str] = ()) -> Dataset:
    """Write the columns of ``df`` that ``spec`` names (or just ``columns``) as Parquet in the
    store and return a small, picklable handle to read them back as torch tensors on any rank.

    ``validation`` is a fraction of rows (random, seeded by ``seed``) or the name of a
    boolean column marking validation rows. Preparing the same DataFrame (same logical
    plan) with the same arguments again in one session returns the files already written.
    The measured shapes and the spec go into the metadata (``ds.spec``).

    With ``in_place`` and no validation column, a plain scan of local Parquet files is read where
    it lies instead (:mod:`sparkring.data.in_place`; ``integral``: class-label columns).

    >>> ds = prepare(df, Store("/tmp/runs"), columns=["features", "label"], validation=0.1, seed=0)  # doctest: +SKIP
    >>> ds.num_rows("train"), ds.shapes["features"]  # doctest: +SKIP
    (900, [64])
    """
    store = store or Store()
    if spec is None:
        if not columns:
            raise DataError("columns= is empty: name the columns to prepare, e.g. ['features', 'label']")
        spec = FeatureSpec.build(df.schema, extra=list(dict.fromkeys(columns)),
                                 codecs=petastorm_codecs(df, store.storage_options))
    validation = _check_validation(df, validation)
    # the files are read (in place) or copied (by pyarrow) unless a validation column needs Spark
    by_files = not isinstance(validation, str)
    if in_place and not isinstance(validation, str):
        scan = scan_facts(df, store, spec)
        if scan is not None:
            return read_in_place(scan, store, run_id=run_id, seed=seed, integral=integral, validation=validation)
    key = _cache_key(df, store, spec, validation, seed) if reuse else None
    # concurrent fits of one DataFrame (CrossValidator's parallelism, a Tuner's trials): the first
    # prepares, the others wait for it and read the same copy
    with reuse_cache.preparing(key):
        cached = reuse_cache.lookup(key)
        if cached is not None:
            return cast(Dataset, cached)
        scan = scan_facts(df, store, spec) if by_files and not in_place else None
        ds = _write(df, store, spec, validation, seed, run_id, scan)
        reuse_cache.remember(key, ds)
        return ds


_REPORT = "split string, path string, rows long, row_groups array<long>, stats string"


def _write_computed(df, store: Store, data_dir: str, spec: FeatureSpec, validation: Any,
                    seed: Optional[int]) -> List[Any]:
    """Spark evaluates the columns; mapInArrow writes them (the rows of each task's report)."""
    from pyspark.sql import functions as F

    selected = [c.spark_column() for c in spec.columns]
    if isinstance(validation, str):
        selected.append(F.coalesce(F.col(f"`{validation}`"), F.lit(False)).alias(VAL_COLUMN))
    elif validation is not None:
        selected.append((F.rand(seed if seed is not None else 0) < validation).alias(VAL_COLUMN))
    else:
        selected.append(F.lit(False).alias(VAL_COLUMN))
    writer = _write_partition_fn(store, data_dir, list(spec.columns))
    return df.select(*selected).mapInArrow(writer, _REPORT).collect()


def _copy_files(spark, scan: ScannedFiles, store: Store, data_dir: str, spec: FeatureSpec,
                validation: Optional[float], seed: Optional[int]) -> List[Any]:
    """The scanned files' columns copied by pyarrow on the executors, two tasks a core (many small
    files share a task and its output file): Spark's own decode and its Arrow hand-over to Python
    cost more than the copy itself (1M rows of a 64-float vector: ~2.4 s against ~1.1 s on 2 cores)."""
    parallelism = spark.sparkContext.defaultParallelism
    units = copy_units(scan.files, parallelism)
    tasks = min(len(units), 2 * max(1, parallelism))
    copier = _copy_partition_fn(store, data_dir, list(spec.columns), units, validation, seed or 0,
                                scan.storage_options)
    log.info("copying %d Parquet file(s) into the Store with pyarrow (%d tasks): the DataFrame only scans them",
             len(scan.files), tasks)
    return spark.range(len(units), numPartitions=tasks).mapInArrow(copier, _REPORT).collect()


def _copy_partition_fn(store: Store, data_dir: str, columns: List[ColumnSpec], units: List[CopyUnit],
                       validation: Optional[float], seed: int, storage_options: Dict[str, Any]):
    """The function mapInArrow runs over unit numbers: copy each unit's rows through the writer a
    computed DataFrame's rows go through (the same checks, statistics and files)."""

    def copy(batches):
        import pyarrow as pa

        writer = _PartitionWriter(store, data_dir, columns)
        for batch in batches:
            for index in batch.column(0).to_pylist():
                for rows, held in unit_batches(units[index], columns, validation, seed, storage_options):
                    writer.add(pa.RecordBatch.from_arrays([*rows.columns, pa.array(held)],
                                                          names=[*rows.schema.names, VAL_COLUMN]))
        yield writer.close()

    return copy


def _write(df, store: Store, spec: FeatureSpec, validation: Any, seed: Optional[int],
           run_id: Optional[str], scan: Optional[ScannedFiles] = None) -> Dataset:
    """The DataFrame's selected columns as Parquet in the Store (one Spark job), with its metadata:
    copied from the files with pyarrow where ``df`` only scans them (``scan``), else as Spark
    computes them."""
    store.check_writable()

    run_id = run_id or uuid.uuid4().hex[:12]
    data_dir = store.data_path(run_id)
    rows = (_copy_files(df.sparkSession, scan, store, data_dir, spec, validation, seed) if scan is not None
            else _write_computed(df, store, data_dir, spec, validation, seed))
    files = [r for r in rows if r["split"] != "stats"]
    try:
        profile = _merge_stats([json.loads(r["stats"]) for r in rows if r["split"] == "stats"], spec.columns)
        spec = spec.measured(_measure(profile, spec.columns))
    except DataError:
        store.delete(data_dir)
        raise

    splits: Dict[str, List[Dict[str, Any]]] = {"train": [], "val": []}
    for row in sorted(files, key=lambda r: r["path"]):
        splits[row["split"]].append({"path": row["path"].rsplit("/", 2)[-2] + "/" + row["path"].rsplit("/", 1)[-1],
                                     "rows": int(row["rows"]), "row_groups": [int(x) for x in row["row_groups"]]})
    values = {c.name: {"min": profile[f"{c.name}__min"], "non_integral": profile[f"{c.name}__non_integral"]}
              for c in spec.columns if _numeric_scalar(c)}
    metadata = {"format": 2, "spec": spec.to_dict(), "splits": splits, "validation": validation, "seed": seed,
                "values": values}
    if not any(f["rows"] for f in splits["train"]):
        store.delete(data_dir)
        raise DataError("every row went to validation: no training rows are left; lower validation=")
    # Files of failed task attempts are not listed: remove them before committing.
    listed = {f["path"] for s in splits.values() for f in s}
    for split in ("train", "val"):
        for name in store.listdir(f"{data_dir}/{split}"):
            if f"{split}/{name}" not in listed:
                store.delete(f"{data_dir}/{split}/{name}")
    store.write_bytes(f"{data_dir}/{METADATA_FILE}", json.dumps(metadata, indent=1).encode())
    ds = Dataset(store, data_dir, metadata)
    return ds
