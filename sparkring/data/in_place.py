"""A DataFrame that only scans Parquet files (local, or on S3 through s3fs), read where the files
lie: the plan check, the row groups, shapes and checks from the files' footers (no Spark job, no
copy), and the Dataset over them. The same survey tells prepare when it can copy the files with
pyarrow (:mod:`sparkring.data.file_copy`) instead of having Spark decode them.

Written by hand because nothing joins the two halves: Spark tells what a DataFrame reads only
through its plan (``inputFiles`` lists the files whatever filters or expressions follow), and
pyarrow reads the footers. Anything this module does not recognise (a filter, a computed or
renamed column, a sparse vector, nested arrays, missing statistics, a file system other than
the local disk and S3) makes it answer None, and ``prepare`` writes the columns as before; so the errors for bad
data stay prepare's. A validation fraction holds out rows drawn per row group, seeded; a
validation column is prepared.
"""
from __future__ import annotations

import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence
from urllib.parse import unquote, urlparse

from .dataset import IN_PLACE, IN_PLACE_SCHEMES, METADATA_FILE, Dataset, open_parquet, s3_options
from .reader import validation_rows
from .spec import SCALAR, TENSOR, ColumnSpec, DataError, FeatureSpec
from .store import Store

log = logging.getLogger(__name__)


def scanned_files(df, names: Sequence[str]) -> Optional[List[str]]:
    """The local paths of the Parquet files ``df`` reads when it is only a scan of them
    (columns selected, nothing filtered, computed, renamed or limited) and ``names`` are
    columns of the files, not of the directory layout; else None.

    >>> scanned_files(spark.read.parquet("/data/train"), ["features", "label"])  # doctest: +SKIP
    ['/data/train/part-00000-....parquet', ...]
    """
    jdf = getattr(df, "_jdf", None)
    if jdf is None:
        return None  # Spark Connect: the plan is not at hand
    try:
        node = jdf.queryExecution().optimizedPlan()
        while node.getClass().getSimpleName() == "Project":
            exprs = node.projectList()
            if any(exprs.apply(i).getClass().getSimpleName() != "AttributeReference" for i in range(exprs.size())):
                return None
            node = node.child()
        if node.getClass().getSimpleName() != "LogicalRelation" or node.isStreaming():
            return None
        relation = node.relation()
        if (relation.getClass().getSimpleName() != "HadoopFsRelation"
                or relation.fileFormat().getClass().getSimpleName() != "ParquetFileFormat"):
            return None
        layout_columns = {f["name"] for f in json.loads(relation.partitionSchema().json())["fields"]}
        uris = list(df.inputFiles())
    except Exception as exc:  # noqa: BLE001 - a plan this Spark shapes otherwise: prepare instead
        log.debug("cannot read the DataFrame's plan (%s): preparing it", exc)
        return None
    if layout_columns & set(names) or not uris or any(urlparse(u).scheme not in IN_PLACE_SCHEMES for u in uris):
        return None
    return [unquote(urlparse(u).path) if urlparse(u).scheme == "file" else u for u in uris]


@dataclass
class FileFacts:
    """What one file's footer says about the needed columns."""

    path: str
    row_groups: List[int]
    widths: Dict[str, int] = field(default_factory=dict)
    minimum: Dict[str, float] = field(default_factory=dict)


def _leaf_chunks(row_group) -> Dict[str, Any]:
    return {row_group.column(j).path_in_schema: row_group.column(j) for j in range(row_group.num_columns)}


def _clean(chunk) -> bool:
    """Whether a column chunk's statistics show no nulls (no null rows, no empty arrays)."""
    stats = chunk.statistics
    return stats is not None and stats.has_null_count and stats.null_count == 0


def _tensor_leaf(col: ColumnSpec, chunks: Dict[str, Any]):
    """A tensor column's element leaf, when the column is a dense vector or a flat array."""
    if col.vector:
        kind = chunks.get(f"{col.name}.type")
        stats = kind.statistics if kind is not None else None
        if not (_clean(kind) and stats is not None and stats.has_min_max and stats.min == stats.max == 1):
            return None  # null or sparse vectors: prepare densifies or reports them
        return chunks.get(f"{col.name}.values.list.element")
    leaves = [p for p in chunks if p.startswith(f"{col.name}.")]
    return chunks[leaves[0]] if len(leaves) == 1 else None


def _file_facts(path: str, columns: Sequence[ColumnSpec],
                storage_options: Optional[Dict[str, Any]] = None) -> Optional[FileFacts]:
    """The file's row groups, each tensor column's row width and each scalar's smallest
    value, from its footer; None where the footer cannot vouch for the layout."""
    import pyarrow as pa

    meta = open_parquet(path, storage_options).metadata
    schema = meta.schema.to_arrow_schema()
    facts = FileFacts(path, [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
    for col in columns:
        if schema.get_field_index(col.name) < 0:
            return None
        kind = schema.field(col.name).type
        expected = (pa.types.is_struct(kind) if col.vector else
                    pa.types.is_list(kind) and (pa.types.is_integer(kind.value_type)
                                                or pa.types.is_floating(kind.value_type)) if col.kind == TENSOR else
                    pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind))
        if not expected:
            return None
    for i, rows in enumerate(facts.row_groups):
        if rows == 0:
            continue
        chunks = _leaf_chunks(meta.row_group(i))
        for col in columns:
            leaf = _tensor_leaf(col, chunks) if col.kind == TENSOR else chunks.get(col.name)
            if leaf is None or not _clean(leaf):
                return None
            if col.kind == TENSOR:
                width, ragged = divmod(leaf.num_values, rows)
                if ragged or facts.widths.setdefault(col.name, width) != width:
                    return None  # ragged: prepare names the lengths
            elif leaf.statistics.has_min_max and not isinstance(leaf.statistics.min, bool):
                low = float(leaf.statistics.min)
                facts.minimum[col.name] = min(low, facts.minimum.get(col.name, low))
    return facts


def _splits(files: Sequence[FileFacts], validation: Optional[float], seed: int) -> Dict[str, List[Dict[str, Any]]]:
    """Each file's rows per row group in the train and val splits (validation_rows draws them)."""
    splits: Dict[str, List[Dict[str, Any]]] = {"train": [], "val": []}
    for i, f in enumerate(files):
        held = [int(validation_rows(seed, i, j, n, validation).sum()) if validation else 0
                for j, n in enumerate(f.row_groups)]
        for split, counts in (("train", [n - h for n, h in zip(f.row_groups, held)]), ("val", held)):
            if split == "train" or validation:
                splits[split].append({"path": f.path, "rows": sum(counts), "row_groups": counts})
    return splits


def _supported(col: ColumnSpec) -> bool:
    return "." not in col.name and (col.kind == SCALAR or (col.kind == TENSOR and col.levels == 1))


@dataclass
class ScannedFiles:
    """The Parquet files a DataFrame only scans, as their footers describe the needed columns:
    what reading them in place, or copying them with pyarrow, starts from."""

    files: List[FileFacts]
    spec: FeatureSpec  # tensor columns measured from the footers
    storage_options: Dict[str, Any]


def scan_facts(df, store: Store, spec: FeatureSpec) -> Optional[ScannedFiles]:
    """The files ``df`` reads and what their footers vouch for, or None when ``df`` is not only a
    scan of local or S3 Parquet files whose footers vouch for every column ``spec`` names (a
    filter, a computed column, a sparse or null vector, ragged arrays: see the module docstring).

    >>> scan_facts(spark.read.parquet("/data/train"), Store("/tmp/runs"), spec).files[0].row_groups  # doctest: +SKIP
    [250000]
    """
    if not all(_supported(c) for c in spec.columns):
        return None
    paths = scanned_files(df, [c.name for c in spec.columns])
    if paths is None:
        return None
    options = s3_options(store)
    with ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:
        facts = list(pool.map(lambda p: _file_facts(p, spec.columns, options), paths))
    found = [f for f in facts if f is not None]
    if len(found) < len(facts) or not any(sum(f.row_groups) for f in found):
        return None
    widths = {name: {f.widths[name] for f in found if name in f.widths} for name in
              [c.name for c in spec.columns if c.kind == TENSOR]}
    if any(len(w) != 1 for w in widths.values()):
        return None
    files = sorted((f for f in found if sum(f.row_groups)), key=lambda f: f.path)
    return ScannedFiles(files, spec.measured({name: [w.pop()] for name, w in widths.items()}), options)


def read_in_place(scan: ScannedFiles, store: Store, run_id: Optional[str] = None, seed: Optional[int] = None,
                  integral: Sequence[str] = (), validation: Optional[float] = None) -> Dataset:
    """A Dataset reading the scanned Parquet files where they lie (``scan_facts`` found them).
    ``integral`` columns (class-index labels) are checked on the ranks as they read; a
    ``validation`` fraction holds out rows drawn per row group (``reader.validation_rows``).

    >>> scan = scan_facts(spark.read.parquet("/data/train"), Store("/tmp/runs"), spec)  # doctest: +SKIP
    >>> read_in_place(scan, Store("/tmp/runs")).num_rows("train")  # doctest: +SKIP
    1000000
    """
    spec, files = scan.spec, scan.files
    values: Dict[str, Dict[str, Any]] = {}
    for c in spec.columns:
        if c.kind == SCALAR and c.dtype != "bool":
            lows = [f.minimum[c.name] for f in files if c.name in f.minimum]
            values[c.name] = {"min": min(lows) if lows else None, "non_integral": None}
    splits = _splits(files, validation, seed or 0)
    if not any(f["rows"] for f in splits["train"]):
        raise DataError("every row went to validation: no training rows are left; lower validation=")
    metadata = {"format": 2, "layout": IN_PLACE, "spec": spec.to_dict(), "validation": validation, "seed": seed,
                "splits": splits, "values": values,
                "integral": [c for c in integral if spec.column(c).kind == SCALAR]}
    store.check_writable()
    data_dir = store.data_path(run_id or uuid.uuid4().hex[:12])
    store.write_bytes(f"{data_dir}/{METADATA_FILE}", json.dumps(metadata, indent=1).encode())
    log.info("reading %d Parquet file(s) in place (%d rows): the DataFrame only scans them",
             len(files), sum(rows for f in files for rows in f.row_groups))
    return Dataset(store, data_dir, metadata)
