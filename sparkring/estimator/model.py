"""SparkRingModel: the fitted Transformer (batched, vectorized inference) and its persistence."""
from __future__ import annotations

import io
import threading
import uuid
from typing import Any, Dict, Iterator, List, Optional

import cloudpickle
import numpy as np
import pandas as pd
import torch
from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable

from . import losses
from .params import SparkRingParams
from .persistence import SparkRingReader, SparkRingWriter

_OUT = "__sparkring_out"
_IN = "__sparkring_features"
_worker_models: Dict[str, torch.nn.Module] = {}
_worker_lock = threading.Lock()


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
        kind, width = self._output_kinds()
        loss = self.getOrDefault("loss")
        batch_size = self.getOrDefault("inferenceBatchSize")
        if kind == "classification":
            schema = "prediction double, probability array<double>, rawPrediction array<double>"
        elif width == 1:
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
        broadcast = spark.sparkContext.broadcast(cloudpickle.dumps(self.getModel().cpu()))
        key = uuid.uuid4().hex
        shapes = [self.featureShapes.get(c, []) for c in self.featureColumns()]
        single_shape = shapes[0] if len(shapes) == 1 and len(shapes[0]) > 1 else None

        empty_columns = (["prediction", "probability", "rawPrediction"] if kind == "classification"
                         else ["prediction"])

        def predict(batches: Iterator[pd.Series]) -> Iterator[pd.DataFrame]:
            model = _load_on_worker(key, broadcast)
            device = next(iter(model.parameters()), torch.zeros(0)).device
            for series in batches:
                if len(series) == 0:
                    yield pd.DataFrame({name: [] for name in empty_columns})
                    continue
                x = np.stack(series.to_numpy()).astype(np.float32, copy=False)
                if single_shape is not None:
                    x = x.reshape(len(x), *single_shape)
                outs = []
                with torch.no_grad():
                    for start in range(0, len(x), batch_size):
                        xb = torch.from_numpy(x[start:start + batch_size]).to(device)
                        outs.append(model(xb).float().cpu())
                preds = losses.predictions(loss, torch.cat(outs))
                frame = {}
                for name, values in preds.items():
                    arr = values.numpy()
                    frame[name] = list(arr) if arr.ndim > 1 else arr
                yield pd.DataFrame(frame)

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
