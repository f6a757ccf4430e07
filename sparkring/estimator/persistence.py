"""Save/load of SparkRingEstimator and SparkRingModel: JSON Params in Spark's metadata
format (so Pipelines load them), Python objects (module, optimizer, callables) with cloudpickle."""
from __future__ import annotations

from typing import Any, Dict, Optional

import cloudpickle
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from ..data import Store
from ..runner import spark_major, to_bytes
from .params import OBJECT_PARAMS

OBJECTS_FILE = "objects.pkl"


class SparkRingWriter(MLWriter):
    def __init__(self, instance, extra: Optional[Dict[str, Any]] = None, blobs: Optional[Dict[str, bytes]] = None):
        super().__init__()
        self.instance = instance
        self.extra = extra or {}
        self.blobs = blobs or {}

    def _handleOverwrite(self, path: str) -> None:
        """Delete what is at ``path`` through the Store (pyarrow/fsspec), as Spark's own
        handler would through Hadoop's FileSystem, which a Spark Connect client cannot reach."""
        from ..runner.driver.session import is_connect

        if not is_connect(self.sparkSession):
            return super()._handleOverwrite(path)
        store = Store(path)
        if store.exists(store.root):
            store.delete(store.root)

    def saveImpl(self, path: str) -> None:
        inst = self.instance
        json_params = {p.name: v for p, v in inst._paramMap.items() if p.name not in OBJECT_PARAMS}
        DefaultParamsWriter.saveMetadata(inst, path, _metadata_context(self.sparkSession), extraMetadata=self.extra,
                                         paramMap=json_params)
        objects = {name: inst.getOrDefault(name) for name in OBJECT_PARAMS if inst.isSet(name)}
        store = Store(path)
        store.write_bytes(store.path(OBJECTS_FILE), to_bytes(objects))
        for name, data in self.blobs.items():
            store.write_bytes(store.path(name), data)


def _metadata_context(spark):
    """What pyspark's DefaultParams metadata functions take: a SparkSession from 4.0 on (also on
    Connect, which has no SparkContext), a SparkContext before (3.5 calls sc.parallelize)."""
    return spark if spark_major() >= 4 else spark.sparkContext


class SparkRingReader(MLReader):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        metadata = DefaultParamsReader.loadMetadata(path, _metadata_context(self.sparkSession))
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        store = Store(path)
        objects = cloudpickle.loads(store.read_bytes(store.path(OBJECTS_FILE)))
        instance._set(**objects)
        instance._after_load(metadata, store)
        return instance
