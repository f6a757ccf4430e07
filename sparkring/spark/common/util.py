"""Horovod's ``horovod.spark.common.util``: ``prepare_data`` writes a DataFrame's training (and
validation) rows to the store's intermediate paths once, for ``fit_on_parquet`` to train on
(Spark's Parquet writer does the work); ``_get_metadata`` describes the columns as Horovod's does."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from pyspark.ml.linalg import DenseVector, SparseVector, VectorUDT
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ...errors import ConfigurationError
from . import constants

log = logging.getLogger(__name__)
VALIDATION_MARK = "__sparkring_validation"  # the column fit_on_parquet marks the validation rows with
_written = {"datasets": 0}  # prepare_data's index of the next dataset, as Horovod's cache counts them


def _check_columns(df: DataFrame, label_columns: Sequence[str], feature_columns: Optional[Sequence[str]]) -> None:
    if not label_columns:
        raise ConfigurationError("prepare_data: label_columns cannot be None or empty")
    for kind, cols in (("label", label_columns), ("feature", feature_columns or [])):
        missing = [c for c in cols if c not in df.columns]
        if missing:
            raise ConfigurationError(f"prepare_data: {kind} column(s) {missing} are not in the DataFrame; it has "
                                     f"{df.columns}")


def _split(df: DataFrame, validation: Union[None, float, str]):
    """(training rows, validation rows or None) by a fraction or a column of 1/True marks."""
    if validation is None or validation == 0:
        return df, None
    if isinstance(validation, str):
        if validation not in df.columns:
            raise ConfigurationError(f"prepare_data: validation column {validation!r} is not in the DataFrame")
        marked = F.col(validation).cast("boolean")
        return df.filter(~marked), df.filter(marked)
    if not 0 < float(validation) < 1:
        raise ConfigurationError(f"prepare_data: validation={validation!r} must be a fraction in (0, 1) or a column")
    train, val = df.randomSplit([1 - float(validation), float(validation)], seed=0)
    return train, val


@contextlib.contextmanager
def prepare_data(num_processes: int, store, df: DataFrame, label_columns: Sequence[str],
                 feature_columns: Optional[Sequence[str]] = None, validation: Union[None, float, str] = None,
                 sample_weight_col: Optional[str] = None, compress_sparse: bool = False,
                 partitions_per_process: int = 10, verbose: int = 0) -> Iterator[int]:
    """Write ``df``'s feature, label (and weight) columns to ``store.get_train_data_path(idx)`` and
    its validation rows to ``store.get_val_data_path(idx)``; yields ``idx`` for ``fit_on_parquet``.
    The files stay in the store afterwards, as Horovod's do.

    >>> with prepare_data(2, store, df, label_columns=["y"], feature_columns=["features"]) as idx:
    ...     model = est.fit_on_parquet(dataset_idx=idx)  # doctest: +SKIP
    """
    if num_processes <= 0 or partitions_per_process <= 0:
        raise ConfigurationError(f"prepare_data: num_proc={num_processes} and partitions_per_process="
                                 f"{partitions_per_process} must both be > 0")
    _check_columns(df, label_columns, feature_columns)
    features = list(feature_columns) if feature_columns is not None else [
        c for c in df.columns if c not in set(label_columns)]
    keep = list(dict.fromkeys([*features, *label_columns, *([sample_weight_col] if sample_weight_col else [])]))
    train, val = _split(df, validation)
    idx = _written["datasets"]
    _written["datasets"] += 1
    partitions = num_processes * partitions_per_process
    train.select(*keep).repartition(partitions).write.mode("overwrite").parquet(store.get_train_data_path(idx))
    if val is not None:
        val.select(*keep).repartition(partitions).write.mode("overwrite").parquet(store.get_val_data_path(idx))
    if verbose:
        print(f"prepared dataset {idx}: {train.count()} training rows in {store.get_train_data_path(idx)}")
    yield idx


def read_prepared(store, dataset_idx: Optional[int] = None) -> DataFrame:
    """The rows ``prepare_data`` wrote, validation rows marked in VALIDATION_MARK (where there are
    some): what ``fit_on_parquet`` fits."""
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
    idx = dataset_idx if dataset_idx is not None else max(_written["datasets"] - 1, 0)
    train_path, val_path = store.get_train_data_path(idx), store.get_val_data_path(idx)
    if not store.exists(train_path):
        raise ConfigurationError(f"fit_on_parquet: no prepared data at {train_path}; run it inside "
                                 "`with util.prepare_data(...)`")
    df = spark.read.parquet(train_path)
    if not store.exists(val_path):
        return df
    train = df.withColumn(VALIDATION_MARK, F.lit(False))
    return train.unionByName(spark.read.parquet(val_path).withColumn(VALIDATION_MARK, F.lit(True)))


def _get_metadata(df: DataFrame) -> Dict[str, Dict[str, Any]]:
    """Horovod's description of each column: its Spark type, shape and intermediate format (one
    Spark job reads the first row for the vectors' sizes)."""
    first = df.first()
    metadata: Dict[str, Dict[str, Any]] = {}
    for field in df.schema.fields:
        value = first[field.name] if first is not None else None
        if isinstance(field.dataType, VectorUDT):
            sparse = isinstance(value, SparseVector)
            size = int(value.size) if value is not None else 0
            metadata[field.name] = {"spark_data_type": SparseVector if sparse else DenseVector,
                                    "is_sparse_vector_only": sparse, "shape": size, "max_size": size,
                                    "intermediate_format": constants.ARRAY}
        else:
            metadata[field.name] = {"spark_data_type": type(field.dataType), "is_sparse_vector_only": False,
                                    "shape": 1, "max_size": 1, "intermediate_format": constants.NOCHANGE}
    return metadata


def to_list(var: Any, length: int) -> Optional[List[Any]]:
    """Horovod's to_list: ``var`` as a list of ``length`` (one value repeated)."""
    if var is None:
        return None
    var = var if isinstance(var, list) else [var]
    if len(var) == 1:
        return var * length
    if len(var) != length:
        raise ValueError(f"List {var} must be length {length} (found: {len(var)})")
    return var
