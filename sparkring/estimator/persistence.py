"""Save/load of SparkRingEstimator and SparkRingModel: JSON Params in Spark's metadata
format (so Pipelines load them), Python objects (module, optimizer, callables) with cloudpickle.

Every file goes through the Store (pyarrow/fsspec), Spark's metadata included: written as
Spark's text writer lays it out (``metadata/part-00000`` and ``_SUCCESS``, which Spark's
readers load), so a model saves to wherever a Store reaches (``s3://`` through s3fs) without
Hadoop's connector for that scheme, and a Spark Connect client needs no Hadoop FileSystem."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import cloudpickle
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter
from typing_extensions import override

from ..data import Store
from ..runner import spark_major, to_bytes
from .params import OBJECT_PARAMS

OBJECTS_FILE = "objects.pkl"
METADATA_DIR = "metadata"


class SparkRingWriter(MLWriter):
    """Saves an estimator or model: pyspark's metadata and JSON Params, object Params pickled, extra
    blobs; ``files`` writes what else belongs in the directory (a model's weights) and returns the
    object Params to pickle instead of the instance's and more metadata."""
    def __init__(self, instance, extra: Optional[Dict[str, Any]] = None, blobs: Optional[Dict[str, bytes]] = None,
                 files: Optional[Callable[[Store], Tuple[Dict[str, Any], Dict[str, Any]]]] = None):
        super().__init__()
        self.instance = instance
        self.extra = extra or {}
        self.blobs = blobs or {}
        self.files = files

    def _handleOverwrite(self, path: str) -> None:
        store = Store(path)
        if store.exists(store.root):
            store.delete(store.root)

    @override
    def saveImpl(self, path: str) -> None:
        inst, store = self.instance, Store(path)
        if store.exists(store.path(METADATA_DIR)):
            raise FileExistsError(f"{path} already holds a saved stage; to replace it, use "
                                  f"write().overwrite().save({path!r})")
        json_params = {p.name: v for p, v in inst._paramMap.items() if p.name not in OBJECT_PARAMS}
        objects = {name: inst.getOrDefault(name) for name in OBJECT_PARAMS if inst.isSet(name)}
        extra = dict(self.extra)
        if self.files is not None:
            instead, more = self.files(store)
            objects.update(instead)
            extra.update(more)
        store.write_bytes(store.path(OBJECTS_FILE), to_bytes(objects))
        for name, data in self.blobs.items():
            store.write_bytes(store.path(name), data)
        # the metadata last: a save cut short leaves no stage that loads half
        metadata = DefaultParamsWriter._get_metadata_to_save(
            inst, _metadata_context(self.sparkSession), extraMetadata=extra, paramMap=json_params)
        store.write_bytes(store.path(METADATA_DIR, "part-00000"), metadata.encode() + b"\n")
        store.write_bytes(store.path(METADATA_DIR, "_SUCCESS"), b"")


def _metadata_context(spark):
    """What pyspark's DefaultParams metadata functions take: a SparkSession from 4.0 on (also on
    Connect, which has no SparkContext), a SparkContext before."""
    return spark if spark_major() >= 4 else spark.sparkContext


def _read_metadata(store: Store) -> Dict[str, Any]:
    """The stage's metadata line, from the one part file Spark's text writer (or ours) left."""
    directory = store.path(METADATA_DIR)
    for name in store.listdir(directory):
        if not name.startswith(("_", ".")):
            line = store.read_bytes(store.path(METADATA_DIR, name)).decode().strip()
            if line:
                return DefaultParamsReader._parseMetaData(line.splitlines()[0])
    raise FileNotFoundError(f"no saved stage at {store.url}: {directory} holds no metadata")


class SparkRingReader(MLReader):
    """Loads what SparkRingWriter saved into a new instance of ``cls``."""
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    @override
    def load(self, path: str):
        store = Store(path)
        metadata = _read_metadata(store)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        objects = cloudpickle.loads(store.read_bytes(store.path(OBJECTS_FILE)))
        instance._set(**objects)
        instance._after_load(metadata, store)
        return instance
