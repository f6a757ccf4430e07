"""reader="petastorm": prepared row groups read through petastorm's ``make_batch_reader``, on
the default reader's plan (the same rows per rank and epoch, in the same order, with the same
dtypes and shapes), for pipelines built around petastorm."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import numpy as np

from ..errors import ConfigurationError, DataError
from .reader import RowGroupReader
from .spec import BYTES, CODED, SMALL_ROW_BYTES, TENSOR, ColumnSpec, FeatureSpec, decoded

READERS = ("arrow", "petastorm")
INSTALL_HINT = ("petastorm imports only with pyarrow < 16 and reads only with pyarrow < 15, so it runs beside "
                "pyspark 3.5: pip install 'sparkring[petastorm]' -c constraints-compat.txt (petastorm 0.12.1, "
                "pyarrow 14.0.2)")


def check_reader(reader: str, name: str = "reader") -> None:
    """Refuse an unknown reader, or petastorm where it cannot be imported, naming what works.

    >>> check_reader("arrow")
    """
    if reader not in READERS:
        raise ConfigurationError(f"{name}={reader!r} is not a reader; use one of {', '.join(map(repr, READERS))}")
    if reader == "petastorm":
        try:
            import petastorm  # noqa: F401
        except ImportError as exc:
            import pyarrow

            raise ConfigurationError(f"{name}='petastorm' but petastorm cannot be imported here ({exc}; pyarrow "
                                     f"{pyarrow.__version__} installed): {INSTALL_HINT}") from exc


def petastorm_row_groups(url_of: Any, row_groups_in: Dict[str, int], spec: FeatureSpec, cols: Sequence[str],
                         storage_options: Optional[Dict[str, Any]] = None) -> RowGroupReader:
    """Read row group ``rg`` of file ``path`` with petastorm: one ``make_batch_reader`` on the
    file, sharded so that its only shard is that row group (petastorm shards by row group)."""
    from petastorm import make_batch_reader

    def read(path: str, rg: int) -> Dict[str, np.ndarray]:
        with make_batch_reader(url_of(path), schema_fields=list(cols), reader_pool_type="dummy",
                               shuffle_row_groups=False, num_epochs=1, cur_shard=rg,
                               shard_count=row_groups_in[path], storage_options=storage_options) as source:
            parts = [part._asdict() for part in source]
        missing = [c for c in cols if parts and c not in parts[0]]
        if missing:
            raise DataError(f"petastorm leaves out column(s) {missing} of {path}: it reads no large_binary "
                            f"column, the storage of tensors over {SMALL_ROW_BYTES} bytes per row; use "
                            "reader='arrow' for them")
        return {c: _decoded([p[c] for p in parts], spec.column(c)) for c in cols}
    return read


def _decoded(chunks, col: ColumnSpec) -> np.ndarray:
    """petastorm's numpy output of one column in the layout ``spec.to_numpy`` gives."""
    values = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    n = len(values)
    if col.kind == TENSOR:  # stored as one fixed-width binary value per row
        data = b"".join(values.tolist()) if values.dtype == object else values.tobytes()
        return np.frombuffer(data, dtype=np.dtype(col.dtype)).reshape(n, *col.shape)
    if col.kind == BYTES:
        return values
    if col.kind == CODED:
        return decoded(values, col)
    return values.astype(np.bool_ if col.dtype == "bool" else np.dtype(col.dtype), copy=False)
