"""DataFrame -> Parquet in the Store: validate columns, encode tensors, record metadata.

Feature vectors and arrays are stored as one binary value per row holding the raw
float32 bytes: measured fastest to decode into torch (4.9M rows/s vs 2.0M for
fixed_size_list and 1.4M for list<float>, 200k x 64 floats, pyarrow 26), and still
readable by plain pyarrow (``np.frombuffer``), with the shape kept in the metadata.
"""
from __future__ import annotations

import json
import threading
import uuid
from typing import Any, Dict, List, Optional, Sequence, Union

from .dataset import Dataset, METADATA_FILE
from .store import Store

VAL_COLUMN = "__sparkring_val"
TARGET_ROW_GROUP_BYTES = 8 * 1024 * 1024

_cache: Dict[tuple, Dataset] = {}
_cache_lock = threading.Lock()


class DataError(ValueError):
    """The DataFrame cannot be turned into tensors; the message names the column and the fix."""


def _kind_of(field) -> Dict[str, Any]:
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    dt = field.dataType
    numeric = (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType)
    if isinstance(dt, numeric) or isinstance(dt, T.BooleanType):
        return {"kind": "scalar", "spark": dt.simpleString()}
    if isinstance(dt, T.DecimalType):
        return {"kind": "scalar", "spark": "double", "cast": "double"}
    if isinstance(dt, VectorUDT):
        return {"kind": "vector"}
    if isinstance(dt, T.ArrayType) and isinstance(dt.elementType, numeric + (T.BooleanType,)):
        return {"kind": "array"}
    hint = {
        "StringType": "index it first (StringIndexer) or drop it",
        "MapType": "flatten it into numeric columns",
        "StructType": "select its numeric fields as columns",
        "ArrayType": "only flat arrays of numbers are supported; flatten nested arrays",
        "BinaryType": "decode it into a numeric array column",
    }.get(type(dt).__name__, "convert it to a numeric, vector or array column")
    raise DataError(f"column {field.name!r} has type {dt.simpleString()}, which cannot become a tensor: {hint}")


def _merge_stats(parts: List[Dict[str, Any]], columns, tensor_cols) -> Dict[str, Any]:
    merged: Dict[str, Any] = {"__rows": sum(p["__rows"] for p in parts)}
    for c in columns:
        merged[f"{c}__nulls"] = sum(p[f"{c}__nulls"] for p in parts)
        if c in tensor_cols:
            los = [p[f"{c}__min"] for p in parts if p[f"{c}__min"] is not None]
            his = [p[f"{c}__max"] for p in parts if p[f"{c}__max"] is not None]
            merged[f"{c}__min"] = min(los) if los else 0
            merged[f"{c}__max"] = max(his) if his else 0
            merged[f"{c}__null_elems"] = sum(p[f"{c}__null_elems"] for p in parts)
    return merged


def _check_profile(profile: Dict[str, Any], columns, kinds) -> None:
    if profile["__rows"] == 0:
        raise DataError("the DataFrame is empty: there is nothing to train on; check upstream filters")
    for c in columns:
        nulls = profile[f"{c}__nulls"] or 0
        if nulls:
            raise DataError(f"column {c!r} has {nulls} null value(s) out of {profile['__rows']} rows: "
                            "fill them (df.fillna / Imputer) or filter them out (df.dropna)")
        if kinds[c]["kind"] in ("vector", "array"):
            lo, hi = profile[f"{c}__min"], profile[f"{c}__max"]
            if lo != hi:
                raise DataError(f"column {c!r} holds {kinds[c]['kind']}s of different lengths ({lo} to {hi}); "
                                "every row must have the same length: pad or truncate them")
            if lo == 0:
                raise DataError(f"column {c!r} holds empty {kinds[c]['kind']}s; they must have at least one element")
            if profile.get(f"{c}__null_elems"):
                raise DataError(f"column {c!r} has {profile[f'{c}__null_elems']} array(s) with null "
                                "elements: fill or drop them")
            kinds[c]["shape"] = [int(lo)]


def _write_partition_fn(store: Store, data_dir: str, columns: List[str], tensor_cols: List[str]):
    """The function mapInArrow runs on executors: check, encode and write one Parquet file
    per split in the same pass, and report what it saw (rows, nulls, lengths) so that the
    driver validates without a separate scan of the data."""

    def write(batches):
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        ctx = TaskContext.get()
        tag = f"{ctx.partitionId():05d}-{ctx.attemptNumber()}-{uuid.uuid4().hex[:8]}" if ctx else uuid.uuid4().hex
        writers: Dict[str, Any] = {}
        pending: Dict[str, List[pa.Table]] = {"train": [], "val": []}
        counts: Dict[str, List[int]] = {"train": [], "val": []}
        stats: Dict[str, Any] = {"__rows": 0}
        for c in columns:
            stats[f"{c}__nulls"] = 0
            if c in tensor_cols:
                stats.update({f"{c}__min": None, f"{c}__max": None, f"{c}__null_elems": 0})
        state = {"ok": True, "row_group_rows": None}

        def observe(batch: pa.RecordBatch) -> bool:
            """Update the stats; False when this batch cannot be written as tensors."""
            ok = True
            stats["__rows"] += batch.num_rows
            for name in columns:
                arr = batch.column(batch.schema.get_field_index(name))
                if arr.null_count:
                    stats[f"{name}__nulls"] += arr.null_count
                    ok = False
                if name in tensor_cols:
                    lengths = pc.list_value_length(arr)
                    lo, hi = pc.min(lengths).as_py(), pc.max(lengths).as_py()
                    if lo is not None:
                        old_lo, old_hi = stats[f"{name}__min"], stats[f"{name}__max"]
                        stats[f"{name}__min"] = lo if old_lo is None else min(old_lo, lo)
                        stats[f"{name}__max"] = hi if old_hi is None else max(old_hi, hi)
                        if stats[f"{name}__min"] != stats[f"{name}__max"] or lo == 0:
                            ok = False
                    values = arr.flatten()
                    if values.null_count:
                        parents = pc.list_parent_indices(arr).to_numpy()
                        mask = values.is_null().to_numpy(zero_copy_only=False)
                        stats[f"{name}__null_elems"] += int(len(np.unique(parents[mask])))
                        ok = False
            return ok

        def encode(batch: pa.RecordBatch) -> pa.Table:
            arrays, names = [], []
            for name in columns:
                arr = batch.column(batch.schema.get_field_index(name))
                if name in tensor_cols:
                    width = len(arr[0]) if len(arr) else 1
                    values = arr.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
                    offsets = np.arange(0, (len(arr) + 1) * width * 4, width * 4, dtype=np.int64)
                    arr = pa.Array.from_buffers(pa.large_binary(), len(arr),
                                                [None, pa.py_buffer(offsets), pa.py_buffer(values)])
                arrays.append(arr)
                names.append(name)
            return pa.Table.from_arrays(arrays, names=names)

        def flush(split: str, final: bool = False):
            row_group_rows = state["row_group_rows"]
            tables = pending[split]
            rows = sum(t.num_rows for t in tables)
            if not rows or (rows < row_group_rows and not final):
                return
            table = pa.concat_tables(tables).combine_chunks()
            full = rows if final else rows - rows % row_group_rows
            if split not in writers:
                path = f"{data_dir}/{split}/part-{tag}.parquet"
                store.makedirs(f"{data_dir}/{split}")
                writers[split] = (pq.ParquetWriter(
                    store.fs.open_output_stream(path), table.schema, compression="NONE",
                    use_dictionary=False, write_statistics=False), path)
            writer = writers[split][0]
            for start in range(0, full, row_group_rows):
                part = table.slice(start, min(row_group_rows, full - start))
                writer.write_table(part, row_group_size=part.num_rows)
                counts[split].append(part.num_rows)
            pending[split] = [table.slice(full)] if full < rows else []

        for batch in batches:
            if batch.num_rows == 0:
                continue
            if not observe(batch):
                state["ok"] = False
            if not state["ok"]:
                continue  # keep counting for the error message, write nothing more
            if state["row_group_rows"] is None:
                row_bytes = sum(4 * len(batch.column(batch.schema.get_field_index(c))[0]) if c in tensor_cols
                                else 8 for c in columns)
                state["row_group_rows"] = int(max(1024, min(1 << 20, TARGET_ROW_GROUP_BYTES // max(1, row_bytes))))
            is_val = batch.column(batch.schema.get_field_index(VAL_COLUMN)).to_numpy(zero_copy_only=False)
            table = encode(batch)
            if is_val.any():
                mask = pa.array(is_val)
                pending["val"].append(table.filter(mask))
                pending["train"].append(table.filter(pc.invert(mask)))
            else:
                pending["train"].append(table)
            for split in ("train", "val"):
                flush(split)
        if state["ok"]:
            for split in ("train", "val"):
                flush(split, final=True)
        out = {"split": [], "path": [], "rows": [], "row_groups": [], "stats": []}
        for split, (writer, path) in writers.items():
            writer.close()
            out["split"].append(split)
            out["path"].append(path)
            out["rows"].append(sum(counts[split]))
            out["row_groups"].append(counts[split])
            out["stats"].append(None)
        out["split"].append("stats")
        out["path"].append(None)
        out["rows"].append(stats["__rows"])
        out["row_groups"].append([])
        out["stats"].append(json.dumps(stats))
        yield pa.RecordBatch.from_pydict(out, schema=pa.schema([
            ("split", pa.string()), ("path", pa.string()), ("rows", pa.int64()),
            ("row_groups", pa.list_(pa.int64())), ("stats", pa.string())]))

    return write


def _cache_key(df, store: Store, columns, validation, seed):
    try:
        plan = df.semanticHash()
    except Exception:  # noqa: BLE001 - no plan hash (Spark Connect variants): no reuse
        return None
    return (plan, df.schema.json(), tuple(columns), validation, seed, store.url)


def prepare(df, store: Optional[Store] = None, columns: Optional[Sequence[str]] = None,
            validation: Union[None, float, str] = None, seed: Optional[int] = None,
            run_id: Optional[str] = None, reuse: bool = True) -> Dataset:
    """Write the ``columns`` of ``df`` as Parquet in the store and return a small,
    picklable handle to read them back as torch tensors on any rank.

    ``validation`` is a fraction of rows (random, seeded by ``seed``) or the name of a
    boolean column marking validation rows. Preparing the same DataFrame (same logical
    plan) with the same arguments again in one session returns the files already written.

    >>> ds = prepare(df, Store("/tmp/runs"), columns=["features", "label"], validation=0.1, seed=0)
    >>> ds.num_rows("train"), ds.shapes["features"]  # doctest: +SKIP
    (900, [64])
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    store = store or Store()
    if not columns:
        raise DataError("columns= is empty: name the columns to prepare, e.g. ['features', 'label']")
    columns = list(dict.fromkeys(columns))
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise DataError(f"column(s) {missing} are not in the DataFrame; it has {df.columns}")
    fields = {f.name: f for f in df.schema.fields}
    kinds = {c: _kind_of(fields[c]) for c in columns}
    if isinstance(validation, str):
        from pyspark.sql.types import BooleanType

        if validation not in df.columns:
            raise DataError(f"validation={validation!r} is not a column of the DataFrame; it has {df.columns}")
        if not isinstance(fields[validation].dataType, BooleanType):
            raise DataError(f"validation column {validation!r} has type {fields[validation].dataType.simpleString()};"
                            " it must be boolean (True marks validation rows)")
    elif validation is not None:
        if isinstance(validation, bool) or not 0 < float(validation) < 1:
            raise DataError(f"validation={validation!r}: give a fraction strictly between 0 and 1, "
                            "or the name of a boolean column")
        validation = float(validation)
    key = _cache_key(df, store, columns, validation, seed) if reuse else None
    if key is not None:
        with _cache_lock:
            cached = _cache.get(key)
        if cached is not None and cached.exists():
            return cached
    store.check_writable()

    run_id = run_id or uuid.uuid4().hex[:12]
    data_dir = store.data_path(run_id)

    selected = []
    tensor_cols = []
    for c in columns:
        col = F.col(f"`{c}`")
        kind = kinds[c]["kind"]
        if kind == "vector":
            col = vector_to_array(col, "float32")
            tensor_cols.append(c)
        elif kind == "array":
            col = col.cast("array<float>")
            tensor_cols.append(c)
        elif kinds[c].get("cast"):
            col = col.cast(kinds[c]["cast"])
        selected.append(col.alias(c))
    if isinstance(validation, str):
        selected.append(F.coalesce(F.col(f"`{validation}`"), F.lit(False)).alias(VAL_COLUMN))
    elif validation is not None:
        selected.append((F.rand(seed if seed is not None else 0) < validation).alias(VAL_COLUMN))
    else:
        selected.append(F.lit(False).alias(VAL_COLUMN))
    writer = _write_partition_fn(store, data_dir, columns, tensor_cols)
    rows = df.select(*selected).mapInArrow(
        writer, "split string, path string, rows long, row_groups array<long>, stats string").collect()
    files = [r for r in rows if r["split"] != "stats"]
    try:
        _check_profile(_merge_stats([json.loads(r["stats"]) for r in rows if r["split"] == "stats"], columns,
                                    tensor_cols), columns, kinds)
    except DataError:
        store.delete(data_dir)
        raise

    schema = {}
    for c in columns:
        if c in tensor_cols:
            schema[c] = {"kind": "tensor", "dtype": "float32", "shape": kinds[c]["shape"]}
        else:
            spark_type = kinds[c].get("cast") or kinds[c]["spark"]
            schema[c] = {"kind": "scalar", "dtype": _SCALAR_DTYPES[spark_type], "shape": []}
    splits: Dict[str, List[Dict[str, Any]]] = {"train": [], "val": []}
    for row in sorted(files, key=lambda r: r["path"]):
        splits[row["split"]].append({"path": row["path"].rsplit("/", 2)[-2] + "/" + row["path"].rsplit("/", 1)[-1],
                                     "rows": int(row["rows"]), "row_groups": [int(x) for x in row["row_groups"]]})
    metadata = {"format": 1, "columns": schema, "splits": splits, "validation": validation, "seed": seed}
    if not any(f["rows"] for f in splits["train"]):
        raise DataError("every row went to validation: no training rows are left; lower validation=")
    # Files of failed task attempts are not listed: remove them before committing.
    listed = {f["path"] for s in splits.values() for f in s}
    for split in ("train", "val"):
        for name in store.listdir(f"{data_dir}/{split}"):
            if f"{split}/{name}" not in listed:
                store.delete(f"{data_dir}/{split}/{name}")
    store.write_bytes(f"{data_dir}/{METADATA_FILE}", json.dumps(metadata, indent=1).encode())
    ds = Dataset(store, data_dir, metadata)
    if key is not None:
        with _cache_lock:
            _cache[key] = ds
    return ds


def forget(ds: Dataset) -> None:
    """Drop ``ds`` from the reuse cache (after its files were deleted)."""
    with _cache_lock:
        for k in [k for k, v in _cache.items() if v.data_dir == ds.data_dir]:
            del _cache[k]


_SCALAR_DTYPES = {"tinyint": "int8", "smallint": "int16", "int": "int32", "bigint": "int64",
                  "float": "float32", "double": "float64", "boolean": "bool"}
