"""Scanned Parquet files as the rows prepare's writer takes: the units of row groups one copy
task reads, and their rows in the form Spark's mapInArrow would hand over (an ML vector as its
``values`` list), with the validation mark drawn per row group as reading in place draws it.

Written by hand because the alternative is Spark's own decode of the files and its Arrow
hand-over to the Python worker, which cost more than pyarrow's read of the same row groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .dataset import open_parquet
from .in_place import FileFacts
from .reader import validation_rows
from .spec import ColumnSpec

# rows pyarrow decodes at a time: a few MB of a wide vector, so a task's memory stays small
COPY_BATCH_ROWS = 32768


@dataclass(frozen=True)
class CopyUnit:
    """Consecutive row groups of one scanned file: what one copy task reads.

    >>> CopyUnit(0, "/data/train/part-0.parquet", (0, 1)).row_groups
    (0, 1)
    """

    file_index: int
    path: str
    row_groups: Tuple[int, ...]


def copy_units(files: Sequence[FileFacts], parallelism: int) -> List[CopyUnit]:
    """The files' non-empty row groups in units of about ``1 / (2 x parallelism)`` of all rows (at
    least one row group each), so every core has work and a late unit is a short one.

    >>> [u.row_groups for u in copy_units([FileFacts("/d/a.parquet", [100, 100, 100, 100])], parallelism=1)]
    [(0, 1), (2, 3)]
    """
    total = sum(sum(f.row_groups) for f in files)
    target = max(1, -(-total // max(1, 2 * parallelism)))
    units: List[CopyUnit] = []
    for index, facts in enumerate(files):
        group: List[int] = []
        rows = 0
        for row_group, count in enumerate(facts.row_groups):
            if count == 0:
                continue
            if group and rows + count > target:
                units.append(CopyUnit(index, facts.path, tuple(group)))
                group, rows = [], 0
            group.append(row_group)
            rows += count
        if group:
            units.append(CopyUnit(index, facts.path, tuple(group)))
    return units


def unit_batches(unit: CopyUnit, columns: Sequence[ColumnSpec], validation: Optional[float], seed: int,
                 storage_options: Optional[Dict[str, Any]] = None) -> Iterator[Tuple[Any, np.ndarray]]:
    """The unit's rows as Arrow record batches of ``columns`` (a vector as its values list), each
    with its validation mark (``validation_rows`` of the row group; all False without one)."""
    import pyarrow as pa

    parquet = open_parquet(unit.path, storage_options)
    names = [c.name for c in columns]
    leaves = [f"{c.name}.values" if c.vector else c.name for c in columns]  # a vector's other fields: not decoded
    for row_group in unit.row_groups:
        rows = parquet.metadata.row_group(row_group).num_rows
        held = (validation_rows(seed, unit.file_index, row_group, rows, validation) if validation
                else np.zeros(rows, dtype=bool))
        start = 0
        for batch in parquet.iter_batches(batch_size=COPY_BATCH_ROWS, row_groups=[row_group], columns=leaves,
                                          use_threads=False):
            arrays = [_as_spark_hands_it(batch.column(i), c) for i, c in enumerate(columns)]
            yield pa.RecordBatch.from_arrays(arrays, names=names), held[start:start + batch.num_rows]
            start += batch.num_rows


def _as_spark_hands_it(column, col: ColumnSpec):
    """A dense ML vector (a struct in the file) as its values list; anything else as read."""
    if not col.vector:
        return column
    return column.flatten()[column.type.get_field_index("values")]  # flatten: the slice's offset applies
