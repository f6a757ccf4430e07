"""Data layer: Store, DataFrame -> Parquet (``prepare``), balanced per-rank batch reader.

>>> from sparkring.data import Store, prepare
>>> ds = prepare(df, Store("/tmp/runs"), columns=["features", "label"])  # doctest: +SKIP
"""
from .dataset import ColumnValues, Dataset
from .petastorm_reader import READERS, check_reader
from .prepare import prepare
from .spec import ColumnSpec, DataError, FeatureSpec, InputSpec
from .store import Store, StoreError
from .unischema import Codec, petastorm_codecs

__all__ = ["Store", "StoreError", "Dataset", "ColumnValues", "prepare", "DataError", "FeatureSpec", "InputSpec",
           "ColumnSpec", "READERS", "check_reader", "Codec", "petastorm_codecs"]
