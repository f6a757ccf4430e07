"""SparkRingModel: the fitted Transformer (batched, vectorized inference); persistence.py saves and loads it."""
from __future__ import annotations

import io
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable
from typing_extensions import override

from ..data import DataError, FeatureSpec, petastorm_codecs
from ..data.text import Encoder
from ..errors import ConfigurationError
from ..runner.gpus import device_ordinal
from ..trainer import losses
from ..trainer.lightning import inference_call
from . import exporting
from .fitted import FittedWeights, stored_fit
from .inference import Predictor, output_fields, pandas_to_arrow
from .params import SparkRingParams
from .persistence import SparkRingReader, SparkRingWriter
from .phases import FitPhases
from .shipping import Shipments, weights_version
from .text import merged
from .text_inference import TextInference, TextPredictor

_OUT = "__sparkring_out"


def task_device(use_gpu: Optional[bool]) -> torch.device:
    """Where this Spark task runs the model: the GPU Spark assigned to the task (by the same
    address rules as the ranks), unless ``useGpu=False``; ``useGpu=True`` insists on one.

    >>> task_device(False)
    device(type='cpu')
    """
    if use_gpu is False:
        return torch.device("cpu")
    from pyspark import TaskContext

    ctx = TaskContext.get()
    gpus = ctx.resources().get("gpu") if ctx is not None else None
    addresses = list(gpus.addresses) if gpus is not None else []
    if torch.cuda.is_available():
        if addresses:
            return torch.device("cuda", device_ordinal(addresses[0]))
        if use_gpu:
            return torch.device("cuda", torch.cuda.current_device())
    elif use_gpu:
        raise ValueError("useGpu=True but torch on this executor has no CUDA device: install a CUDA build "
                         "of torch on the executors, or set useGpu=False for transform")
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


class _Loaded:
    """The module read from a fit's weights (and its weights' version then), shared by a model's copies."""

    def __init__(self) -> None:
        self.module: Optional[torch.nn.Module] = None
        self.version: Any = None
        self.lock = threading.Lock()


class SparkRingModel(Model, SparkRingParams, MLReadable, MLWritable):
    """The trained model: a pyspark.ml Model wrapping rank 0's torch module.

    >>> model = est.fit(df)  # doctest: +SKIP
    >>> model.transform(df).select("prediction", "probability").show()  # doctest: +SKIP
    >>> model.getModel()  # the torch.nn.Module  # doctest: +SKIP
    >>> model.history[-1]["loss"]  # doctest: +SKIP
    >>> model.write().overwrite().save("/tmp/m"); SparkRingModel.load("/tmp/m")  # doctest: +SKIP
    """

    def __init__(self):
        super().__init__()
        self.history: List[Dict[str, Any]] = []
        self.phases: Optional[FitPhases] = None  # where the fit's wall time went (not saved)
        self.featureSpec: Optional[FeatureSpec] = None
        self.outputShapes: Optional[List[List[int]]] = None
        self._shipments = Shipments()  # shared with copies: the same module ships once
        # where a fit left the weights: the model Param is then the recipe that builds the module around them
        self.weights: Optional[FittedWeights] = None
        self._loaded = _Loaded()  # shared with copies: read from storage once

    def getModel(self) -> torch.nn.Module:
        """The trained torch module (rank 0's weights, on CPU), read from the fit's Store on the
        first call (the weights never pass through Spark or the driver until asked for).

        >>> net = model.getModel(); net(torch.randn(1, 64))  # doctest: +SKIP
        """
        recipe = self.getOrDefault(self.model)  # read often (transform, save): not the whole config
        if self.weights is None:
            return recipe
        with self._loaded.lock:
            if self._loaded.module is None:
                self._loaded.module = self.weights.load(recipe, torch.device("cpu")).eval()
                self._loaded.version = weights_version(self._loaded.module)
            return self._loaded.module

    def _weights_on_storage(self) -> Optional[FittedWeights]:
        """Where the module's weights lie as they are (None: no fit left them, or the module read
        from there was changed on the driver since)."""
        loaded = self._loaded.module
        if self.weights is not None and (loaded is None or weights_version(loaded) == self._loaded.version):
            return self.weights
        return None

    def _shippable(self) -> Any:
        """What transform() ships: the recipe and the weights' place (each executor reads the Store
        once), or the module itself where it was changed on the driver since it was read."""
        stored = self._weights_on_storage()
        if stored is not None and stored.executors_read:
            return stored_fit(self.getOrDefault(self.model), stored)
        return self.getModel()

    def _set(self, **kwargs: Any):
        if "model" in kwargs:  # a module set anew: the fitted weights on storage are no longer its
            self.weights, self._loaded = None, _Loaded()
        return super()._set(**kwargs)

    @override
    def copy(self, extra=None):
        weights, loaded = self.weights, self._loaded
        that = super().copy(extra)
        if not any(getattr(p, "name", p) == "model" for p in (extra or {})):
            that.weights, that._loaded = weights, loaded
        that.history = list(self.history)
        that.phases = self.phases
        that.featureSpec = self.featureSpec
        that.outputShapes = self.outputShapes
        return that

    def _inference_spec(self, dataset=None) -> FeatureSpec:
        """The spec the model was trained with (its inputs only), or one built from the Params
        and ``dataset``'s schema (a model loaded without one); checked against ``dataset``."""
        cfg = self.config()
        transform_fn = cfg.transform_fn_for_inference
        if self.featureSpec is not None:
            spec = self.featureSpec
        elif dataset is None:
            raise ValueError("this model carries no feature specification (SparkRingEstimator.fit did not make "
                             "it): give the DataFrame to score")
        else:
            try:
                spec = FeatureSpec.build(dataset.schema, inputs=cfg.model_inputs,
                                         features=cfg.feature_columns, shapes=cfg.input_shapes,
                                         transform=transform_fn is not None, codecs=petastorm_codecs(dataset))
            except DataError as exc:
                raise ValueError(str(exc)) from None
        needed = [c for inp in spec.inputs for c in inp.columns]
        missing = [c for c in needed if dataset is not None and c not in dataset.columns]
        if missing:
            param = "modelInputs" if cfg.model_inputs is not None else "featuresCol"
            raise ValueError(f"{param} column(s) {missing} are not in the DataFrame to transform; it has "
                             f"{dataset.columns}")
        columns = tuple(spec.column(c) for c in dict.fromkeys(needed))
        return FeatureSpec(columns=columns, inputs=spec.inputs, keyword=spec.keyword, transform=spec.transform)

    def _head_kinds(self, spec: FeatureSpec) -> List[Tuple[str, int]]:
        """Per head: 'classification', or 'regression' with its output width."""
        cfg = self.config()
        loss_list = cfg.losses
        shapes: Optional[List[List[int]]] = self.outputShapes
        if shapes is None and not all(isinstance(x, str) and x in losses.CLASSIFICATION for x in loss_list):
            example = spec.example_args()
            if example is None:
                raise ValueError("the model's output shapes are unknown (it was not fitted here and a transformFn "
                                 "decides its inputs): set model.outputShapes, e.g. [[1]]")
            module = self.getModel()
            was_training = module.training
            module.eval()
            with torch.no_grad():
                out = inference_call(module)(*example[0], **example[1])
            module.train(was_training)
            outs = list(out) if len(loss_list) > 1 else [out]
            shapes = [list(o.shape[1:]) for o in outs]
        assert shapes is not None or all(isinstance(x, str) and x in losses.CLASSIFICATION for x in loss_list)
        kinds = []
        for i, loss in enumerate(loss_list):
            if isinstance(loss, str) and loss in losses.CLASSIFICATION:
                kinds.append(("classification", 0))
            else:
                width = 1
                for d in (shapes or [])[i]:
                    width *= d
                kinds.append(("regression", width))
        return kinds

    def _predictor(self, dataset=None) -> Predictor:
        """The inference recipe for this DataFrame's columns (see inference.Predictor)."""
        cfg = self.config()
        spec = self._inference_spec(dataset)
        loss_list = cfg.losses
        fields = output_fields(loss_list, self._head_kinds(spec), cfg.prediction_columns,
                               self.getProbabilityCol(), self.getRawPredictionCol())
        return Predictor(spec=spec, loss_list=tuple(loss_list), fields=fields,
                         batch_size=cfg.inference_batch_size,
                         transform_fn=cfg.transform_fn_for_inference)

    def _transform(self, dataset):
        cfg = self.config()
        if cfg.inference != "predict" or cfg.text_col is not None:
            return self._transform_text(dataset)
        return self._transform_predict(dataset)

    def _transform_text(self, dataset):
        """generate, embed or score textCol's documents, in inferenceBatchSize batches on the executors."""
        from pyspark.sql import functions as F
        from pyspark.sql.functions import pandas_udf

        cfg = self.config()

        recipe, encoder = self._text_inference(dataset)
        # the tokenizer travels with the weights, loaded once per Python worker, not in every task's closure
        shipped = self._shipments.ship(dataset.sparkSession, self._shippable(), tokenizer=encoder)
        use_gpu, batch = cfg.use_gpu, cfg.inference_batch_size

        def values(texts: pd.Series) -> List[Any]:
            device = task_device(use_gpu)
            model = shipped.load(device)
            return recipe.run(model, shipped.tokenizer(), device, list(texts), batch)

        def infer(batches: Iterator[pd.Series]) -> Iterator[pd.Series]:
            for texts in batches:
                yield pd.Series(values(texts), dtype=object)

        def infer_scores(batches: Iterator[pd.Series]) -> Iterator[pd.DataFrame]:
            for texts in batches:
                yield pd.DataFrame(values(texts), columns=["loss", "perplexity"])

        udf = pandas_udf(infer_scores if recipe.mode == "score" else infer, recipe.spark_type)
        return dataset.withColumn(self.getPredictionCol(), udf(F.col(cfg.text_col)))

    def _text_inference(self, dataset=None) -> Tuple[TextInference, Encoder]:
        """What transform() runs on textCol's documents, and the tokenizer it runs with."""
        cfg = self.config()
        mode, column = cfg.inference, cfg.text_col
        if column is None:
            raise ConfigurationError(f"inference={mode!r} needs a model fitted on a text column (textCol, task); this "
                                     "one reads numeric columns: use inference='predict'")
        if dataset is not None and column not in dataset.columns:
            raise ConfigurationError(f"inference={mode!r} reads textCol={column!r}, which the DataFrame lacks "
                                     f"(it has {dataset.columns})")
        if mode == "predict" and cfg.task != "sequence-classification":
            raise ConfigurationError("a language model fitted on textCol writes with inference='generate', 'embed' or "
                                     "'score' (inference='predict' is a sequence classifier's)")
        if mode in ("generate", "score") and cfg.task == "masked-lm":
            raise ConfigurationError(f"inference={mode!r} is a causal language model's (next tokens); a masked-LM "
                                     "encoder writes with inference='embed'")
        if mode == "generate" and not hasattr(self.getModel(), "generate"):
            raise ConfigurationError(f"inference='generate' needs a model with generate() (a Hugging Face causal LM); "
                                     f"{type(self.getModel()).__name__} has none: use 'embed' or 'score'")
        encoder = Encoder(cfg.tokenizer)
        eos, pad = encoder.special_ids()
        return TextInference(mode, eos, pad, max_length=cfg.sequence_length,
                             generation=dict(cfg.generation or {})), encoder

    def _text_predictor(self) -> TextPredictor:
        """A text model's recipe for a pandas DataFrame of documents (the MLflow pyfunc's)."""
        cfg = self.config()
        recipe, encoder = self._text_inference()
        assert cfg.text_col is not None  # _text_inference refuses a model without one
        return TextPredictor(recipe, encoder, cfg.text_col, self.getPredictionCol(), cfg.inference_batch_size)

    def _transform_predict(self, dataset):
        from pyspark.ml.functions import array_to_vector
        from pyspark.ml.linalg import VectorUDT
        from pyspark.sql import functions as F
        from pyspark.sql.functions import pandas_udf

        cfg = self.config()

        predictor = self._predictor(dataset)
        spark = dataset.sparkSession
        if any(isinstance(f.dataType, VectorUDT) for f in dataset.schema.fields):
            _avoid_columnar_udf_input_with_udts(spark)
        shipped = self._shipments.ship(spark, self._shippable())
        use_gpu = cfg.use_gpu

        def forward(arrays: Sequence[pa.Array]) -> List[np.ndarray]:
            device = task_device(use_gpu)
            return predictor.forward(shipped.load(device), device, arrays)

        inputs = [c.spark_column() for c in predictor.spec.columns]
        arrow_udf = getattr(F, "arrow_udf", None)
        if arrow_udf is not None:
            # Spark >= 4.1: Arrow in, Arrow out, no per-row Python objects either way.
            def predict_arrow(batches: Iterator[Tuple[pa.Array, ...]]) -> Iterator[pa.Array]:
                for arrays in batches:
                    arrays = arrays if isinstance(arrays, tuple) else (arrays,)
                    n = len(arrays[0])
                    yield predictor.to_arrow(forward(arrays), n) if n else pa.array([], type=predictor.struct_type())

            udf = arrow_udf(predict_arrow, predictor.spark_schema())
        else:
            def predict(batches: Iterator[Tuple[pd.Series, ...]]) -> Iterator[pd.DataFrame]:
                for series in batches:
                    series = series if isinstance(series, tuple) else (series,)
                    if not len(series[0]):
                        yield pd.DataFrame({f.name: [] for f in predictor.fields})
                        continue
                    columns = forward([pandas_to_arrow(s) for s in series])
                    yield pd.DataFrame({f.name: list(v) if v.ndim > 1 else v
                                        for f, v in zip(predictor.fields, columns)})

            udf = pandas_udf(predict, predictor.spark_schema())
        out = dataset.withColumn(_OUT, udf(*inputs))
        if predictor.single_classifier:
            out = (out.withColumn(self.getPredictionCol(), F.col(f"{_OUT}.prediction"))
                   .withColumn(self.getProbabilityCol(), array_to_vector(F.col(f"{_OUT}.probability")))
                   .withColumn(self.getRawPredictionCol(), array_to_vector(F.col(f"{_OUT}.rawPrediction"))))
        else:
            for f in predictor.fields:
                out = out.withColumn(f.column, F.col(f"{_OUT}.{f.name}"))
        return out.drop(_OUT)

    # -- persistence ------------------------------------------------------------------
    def write(self):
        """Saves Params and code pickled (factory, loss, callables; never weights), the weights under
        ``<path>/model/`` as the ecosystem loads them (exporting.py: a Hugging Face or peft directory,
        or model.safetensors; the files the ranks wrote copied where they still hold the weights), the
        history and feature specification in the metadata."""
        recipe, saved = self.getOrDefault(self.model), self
        tokenizer = self.getOrDefault(self.tokenizer) if self.isDefined(self.tokenizer) else None
        # the weights as the ranks wrote them are copied, never read here, unless LoRA merges them
        stored = self._weights_on_storage() if not self.config().merge_adapters else None
        module = self.getModel() if stored is None else None
        if module is not None and self.config().merge_adapters and hasattr(module, "merge_and_unload"):
            module = recipe = merged(module)
            saved = self.copy({self.getParam("model"): module, self.getParam("lora"): None})
        if self.weights is None:
            recipe = module

        def files(store) -> Tuple[Dict[str, Any], Dict[str, Any]]:
            done = exporting.export_stored(stored, recipe, tokenizer, store) if stored is not None else None
            if done is None:
                done = exporting.export(module if module is not None else self.getModel(), recipe, tokenizer, store)
            return {"model": done.recipe}, {"modelForm": done.form}

        extra = {"history": self.history, "outputShapes": self.outputShapes,
                 "featureSpec": self.featureSpec.to_dict() if self.featureSpec is not None else None}
        return SparkRingWriter(saved, extra=extra, files=files)

    @classmethod
    @override
    def read(cls):
        return SparkRingReader(cls)

    def _after_load(self, metadata, store) -> None:
        self.history = list(metadata.get("history", []))
        spec = metadata.get("featureSpec")
        self.featureSpec = FeatureSpec.from_dict(spec) if spec else None
        self.outputShapes = metadata.get("outputShapes")
        if store.exists(store.path("state_dict.pt")):  # saved by an earlier version: the module pickled whole
            state = torch.load(io.BytesIO(store.read_bytes(store.path("state_dict.pt"))), map_location="cpu",
                               weights_only=True)
            self.getModel().load_state_dict(state)
            return
        recipe, weights, module = exporting.imported(metadata["modelForm"], self.getOrDefault(self.model), store)
        self._set(model=module if module is not None else recipe)
        self.weights = weights
