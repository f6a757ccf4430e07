"""SparkRingModel: the fitted Transformer (batched, vectorized inference) and its persistence."""
from __future__ import annotations

import io
import threading
import uuid
from typing import Any, Dict, Iterator, List

import cloudpickle
import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable

from . import losses
from .params import SparkRingParams
from .persistence import SparkRingReader, SparkRingWriter

_OUT = "__sparkring_out"
_worker_models: Dict[str, torch.nn.Module] = {}
_worker_lock = threading.Lock()


class _InlineBytes:
    """The model's bytes carried in the UDF's closure, where a session has no broadcast
    variables (Spark Connect: the closure travels in the plan, up to the server's gRPC
    message limit, spark.connect.grpc.maxInboundMessageSize, 128 MiB by default)."""

    def __init__(self, value: bytes):
        self.value = value


def _ship(spark, data: bytes):
    """A broadcast variable on classic sessions, the bytes themselves on Spark Connect."""
    from ..runner.session import is_connect

    return _InlineBytes(data) if is_connect(spark) else spark.sparkContext.broadcast(data)


def _load_on_worker(key: str, broadcast) -> torch.nn.Module:
    """Deserialize the model once per Python worker and reuse it for every batch and task."""
    with _worker_lock:
        model = _worker_models.get(key)
        if model is None:
            model = cloudpickle.loads(broadcast.value)
            model.eval()
            device = _worker_device()
            model.to(device)
            while len(_worker_models) >= 2:  # bounded: old transforms' models go
                _worker_models.pop(next(iter(_worker_models)))
            _worker_models[key] = model
        return model


def _worker_device() -> torch.device:
    if torch.cuda.is_available():
        try:
            from pyspark import TaskContext

            ctx = TaskContext.get()
            gpus = ctx.resources().get("gpu") if ctx is not None else None
            if gpus is not None and gpus.addresses:
                return torch.device("cuda", int(gpus.addresses[0]))
        except Exception:  # noqa: BLE001 - fall back to the default GPU
            pass
        return torch.device("cuda")
    return torch.device("cpu")


_COLUMNAR_INPUT_CONF = "spark.sql.execution.arrow.pythonUDF.columnarInput.enabled"


def _avoid_columnar_udf_input_with_udts(spark) -> None:
    """Spark 4.3 feeds pandas UDFs over columnar scans (Parquet) through a row-to-columnar
    converter that has no case for user-defined types such as ML vectors, so any DataFrame
    read from Parquet with a vector column fails with UNSUPPORTED_DATATYPE. Turning the
    optimization off for the session keeps transform() working; it changes nothing else."""
    try:
        if str(spark.conf.get(_COLUMNAR_INPUT_CONF)).lower() == "true":
            spark.conf.set(_COLUMNAR_INPUT_CONF, "false")
    except Exception:  # noqa: BLE001 - older Spark has no such conf: nothing to avoid
        pass


class SparkRingModel(Model, SparkRingParams, MLReadable, MLWritable):
    """The trained model: a pyspark.ml Model wrapping rank 0's torch module.

    >>> model = est.fit(df)
    >>> model.transform(df).select("prediction", "probability").show()  # doctest: +SKIP
    >>> model.getModel()  # the torch.nn.Module  # doctest: +SKIP
    >>> model.history[-1]["loss"]  # doctest: +SKIP
    >>> model.write().overwrite().save("/tmp/m"); SparkRingModel.load("/tmp/m")  # doctest: +SKIP
    """

    def __init__(self):
        super().__init__()
        self.history: List[Dict[str, Any]] = []
        self.featureShapes: Dict[str, List[int]] = {}

    def getModel(self) -> torch.nn.Module:
        """The trained torch module (rank 0's weights, on CPU).

        >>> net = model.getModel(); net(torch.randn(1, 64))  # doctest: +SKIP
        """
        return self.getOrDefault("model")

    def copy(self, extra=None):
        that = super().copy(extra)
        that.history = list(self.history)
        that.featureShapes = dict(self.featureShapes)
        return that

    def _feature_width(self) -> int:
        width = 0
        for c in self.featureColumns():
            shape = self.featureShapes.get(c, [])
            n = 1
            for d in shape:
                n *= d
            width += n
        return width

    def _output_kinds(self):
        loss = self.getOrDefault("loss")
        if isinstance(loss, str) and loss in losses.CLASSIFICATION:
            return "classification", None
        module = self.getModel()
        was_training = module.training
        module.eval()
        with torch.no_grad():
            out = module(torch.zeros(2, self._feature_width()))
        module.train(was_training)
        width = out.reshape(2, -1).shape[1]
        return "regression", width

    def _transform(self, dataset):
        from pyspark.ml.functions import array_to_vector, vector_to_array
        from pyspark.ml.linalg import VectorUDT
        from pyspark.sql import functions as F
        from pyspark.sql.functions import pandas_udf

        missing = [c for c in self.featureColumns() if c not in dataset.columns]
        if missing:
            raise ValueError(f"featuresCol {missing} not in the DataFrame to transform; it has {dataset.columns}")
        kind, out_width = self._output_kinds()
        loss = self.getOrDefault("loss")
        batch_size = self.getOrDefault("inferenceBatchSize")
        if kind == "classification":
            schema = "prediction double, probability array<double>, rawPrediction array<double>"
        elif out_width == 1:
            schema = "prediction double"
        else:
            schema = "prediction array<double>"
        fields = {f.name: f.dataType for f in dataset.schema.fields}
        parts = []
        for c in self.featureColumns():
            col = F.col(f"`{c}`")
            if isinstance(fields[c], VectorUDT):
                parts.append(vector_to_array(col, "float32"))
            elif type(fields[c]).__name__ == "ArrayType":
                parts.append(col.cast("array<float>"))
            else:
                parts.append(F.array(col.cast("float")))
        packed = parts[0] if len(parts) == 1 else F.concat(*parts)
        spark = dataset.sparkSession
        if any(isinstance(f.dataType, VectorUDT) for f in dataset.schema.fields):
            _avoid_columnar_udf_input_with_udts(spark)
        broadcast = _ship(spark, cloudpickle.dumps(self.getModel().cpu()))
        key = uuid.uuid4().hex
        shapes = [self.featureShapes.get(c, []) for c in self.featureColumns()]
        single_shape = shapes[0] if len(shapes) == 1 and len(shapes[0]) > 1 else None

        in_width = self._feature_width()

        def forward(x: np.ndarray) -> Dict[str, np.ndarray]:
            model = _load_on_worker(key, broadcast)
            device = next(iter(model.parameters()), torch.zeros(0)).device
            if single_shape is not None:
                x = x.reshape(len(x), *single_shape)
            outs = []
            with torch.no_grad():
                for start in range(0, len(x), batch_size):
                    xb = torch.from_numpy(x[start:start + batch_size]).to(device)
                    outs.append(model(xb).float().cpu())
            if not outs:
                return {}
            return {name: v.numpy() for name, v in losses.predictions(loss, torch.cat(outs)).items()}

        names = ["prediction", "probability", "rawPrediction"] if kind == "classification" else ["prediction"]
        arrow_udf = getattr(F, "arrow_udf", None)
        if arrow_udf is not None:
            # Spark >= 4.1: Arrow in, Arrow out, no per-row Python objects either way.
            scalar_prediction = kind == "classification" or out_width == 1
            struct_type = pa.struct([(name, pa.float64() if name == "prediction" and scalar_prediction
                                      else pa.list_(pa.float64())) for name in names])

            def predict_arrow(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
                for arr in batches:
                    n = len(arr)
                    if n == 0:
                        yield pa.array([], type=struct_type)
                        continue
                    x = arr.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
                    preds = forward(x.reshape(n, in_width))
                    fields = []
                    for name in names:
                        values = preds[name]
                        if values.ndim == 1:
                            fields.append(pa.array(values, type=pa.float64()))
                        else:
                            k = values.shape[1]
                            offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
                            fields.append(pa.ListArray.from_arrays(
                                offsets, pa.array(values.reshape(-1), type=pa.float64())))
                    yield pa.StructArray.from_arrays(fields, names=names)

            udf = arrow_udf(predict_arrow, schema)
        else:
            def predict(batches: Iterator[pd.Series]) -> Iterator[pd.DataFrame]:
                for series in batches:
                    if len(series) == 0:
                        yield pd.DataFrame({name: [] for name in names})
                        continue
                    preds = forward(np.stack(series.to_numpy()).astype(np.float32, copy=False))
                    yield pd.DataFrame({n: list(v) if v.ndim > 1 else v for n, v in preds.items()})

            udf = pandas_udf(predict, schema)
        out = dataset.withColumn(_OUT, udf(packed))
        pred = F.col(f"{_OUT}.prediction")
        out = out.withColumn(self.getPredictionCol(), pred)
        if kind == "classification":
            out = (out.withColumn(self.getProbabilityCol(), array_to_vector(F.col(f"{_OUT}.probability")))
                   .withColumn(self.getRawPredictionCol(), array_to_vector(F.col(f"{_OUT}.rawPrediction"))))
        return out.drop(_OUT)

    # -- persistence ------------------------------------------------------------------
    def write(self):
        buf = io.BytesIO()
        torch.save(self.getModel().state_dict(), buf)
        return SparkRingWriter(self, extra={"history": self.history, "featureShapes": self.featureShapes},
                               blobs={"state_dict.pt": buf.getvalue()})

    @classmethod
    def read(cls):
        return SparkRingReader(cls)

    def _after_load(self, metadata, store) -> None:
        self.history = list(metadata.get("history", []))
        self.featureShapes = dict(metadata.get("featureShapes", {}))
        state = torch.load(io.BytesIO(store.read_bytes(store.path("state_dict.pt"))), map_location="cpu")
        self.getModel().load_state_dict(state)
