"""Horovod's ``TorchEstimator`` and ``TorchModel`` over sparkring's estimator: Horovod's keywords
translated into SparkRingEstimator Params in one table, and Horovod's semantics where its users
depend on them (the rate scaled by the number of processes, labels reshaped to the output, sample
weights through ``reduction='none'``, ``<label>__output`` columns). No second trainer: ``fit()``
is SparkRingEstimator's.

>>> est = TorchEstimator(num_proc=2, store=Store.create("/tmp/hvd"), model=model, optimizer=opt,
...                      loss=F.binary_cross_entropy, input_shapes=[[2]], feature_cols=["features"],
...                      label_cols=["y"], batch_size=1, epochs=3)  # doctest: +SKIP
>>> est.fit(df).transform(df).select("y__output").show()  # doctest: +SKIP
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence

from pyspark.ml.functions import array_to_vector
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ...errors import ConfigurationError
from ...estimator import SparkRingEstimator, SparkRingModel
from ...estimator.config import EstimatorConfig
from ...estimator.fitting import FitContext
from ...trainer.lightning import is_lightning_module
from ..common.backend import Backend, SparkBackend
from .losses import horovod_losses
from .transformation import RowTransformation, untransformed

log = logging.getLogger(__name__)

# Horovod's keyword -> the SparkRingEstimator Param it sets as it is
SAME_MEANING = {
    "num_proc": "numProc", "model": "model", "store": "store", "optimizer": "optimizer", "metrics": "metrics",
    "loss_weights": "lossWeights", "sample_weight_col": "sampleWeightCol", "validation": "validation",
    "callbacks": "callbacks", "batch_size": "batchSize", "val_batch_size": "valBatchSize", "epochs": "epochs",
    "verbose": "verbose", "random_seed": "seed", "shuffle": "shuffle", "run_id": "runId",
    "train_steps_per_epoch": "trainStepsPerEpoch", "validation_steps_per_epoch": "validationStepsPerEpoch",
    "backward_passes_per_step": "backwardPassesPerStep",
}
# Horovod's keywords that tune Petastorm's reader or Horovod's processes: accepted, said once, not used
NOT_USED = {
    "shuffle_buffer_size": "sparkring shuffles whole epochs", "partitions_per_process": "each rank reads its rows",
    "reader_pool_type": "sparkring's reader is pyarrow", "inmemory_cache_all": "sparkring keeps what fits",
    "train_reader_num_workers": "sparkring's reader is pyarrow", "val_reader_num_workers": "sparkring's reader",
    "mp_start_method": "sparkring decides how its processes start",
    "continuous_cols": "NVTabular's, not used", "categorical_cols": "NVTabular's, not used",
    "transformation_edit_fields": "sparkring reads the columns transformation_fn returns",
    "transformation_removed_fields": "the model reads only its input and label columns",
}
HOROVOD_DEFAULTS = {"reader_pool_type": "thread", "inmemory_cache_all": False}
# Horovod's keywords sparkring's trainer has no counterpart for: refused, naming what to do instead
REFUSED = {
    "data_module": "sparkring reads the prepared Parquet itself; drop data_module",
}


def model_inputs(feature_cols: Optional[Sequence[str]], input_shapes: Optional[Sequence[Sequence[int]]]
                 ) -> Dict[str, Any]:
    """Horovod's feature columns (each one input of forward()) and shapes (a leading -1 for the batch
    allowed) as featuresCol or modelInputs, and inputShapes.

    >>> model_inputs(["features"], [[-1, 1, 28, 28]])
    {'featuresCol': 'features', 'inputShapes': [1, 28, 28]}
    >>> model_inputs(["a", "b"], [[2], [3]])
    {'modelInputs': ['a', 'b'], 'inputShapes': [[2], [3]]}
    """
    out: Dict[str, Any] = {}
    shapes = [list(s[1:]) if s and s[0] == -1 else list(s) for s in (input_shapes or [])]
    if feature_cols is not None:
        cols = [feature_cols] if isinstance(feature_cols, str) else list(feature_cols)
        if len(cols) == 1:
            out["featuresCol"] = cols[0]
        else:
            out["modelInputs"] = cols
        if shapes:
            out["inputShapes"] = shapes[0] if len(cols) == 1 else shapes
    elif shapes:
        out["inputShapes"] = shapes[0] if len(shapes) == 1 else shapes
    return out


def compression_name(compression: Any) -> str:
    """Horovod's ``Compression.fp16`` (sparkring's or Horovod's own class) as gradientCompression's value."""
    if compression is None:
        return "none"
    if isinstance(compression, str):
        return compression
    name = getattr(compression, "__name__", type(compression).__name__).lower()
    for known in ("fp16", "bf16"):
        if known in name:
            return known
    return "none"


def say_not_used(given: Dict[str, Any]) -> None:
    """Log once each keyword given that sparkring accepts and has no use for (NOT_USED), and why."""
    for name, why in NOT_USED.items():
        if given.get(name) is not None and given.get(name) != HOROVOD_DEFAULTS.get(name):
            log.info("TorchEstimator(%s=%r) is accepted and not used: %s", name, given[name], why)


def translate(given: Dict[str, Any]) -> Dict[str, Any]:
    """TorchEstimator's keywords as SparkRingEstimator Params (None means "not given").

    >>> translate({"batch_size": 8, "label_cols": ["y"], "use_gpu": True, "gradient_compression": None})
    {'batchSize': 8, 'labelCol': ['y'], 'useGpu': None}
    """
    for name, why in REFUSED.items():
        if given.get(name) is not None:
            raise ConfigurationError(f"TorchEstimator({name}=...) is not supported by sparkring: {why}")
    say_not_used(given)
    params = {ours: given[theirs] for theirs, ours in SAME_MEANING.items() if given.get(theirs) is not None}
    if given.get("label_cols") is not None:
        params["labelCol"] = list(given["label_cols"])
    if given.get("loss") is not None or given.get("loss_constructors"):
        heads = len(given.get("label_cols") or [None])
        params["loss"] = horovod_losses(given.get("loss"), given.get("loss_constructors"), heads,
                                        given.get("label_shapes"))
    params.update(model_inputs(given.get("feature_cols"), given.get("input_shapes")))
    if given.get("transformation_fn") is not None:  # Petastorm ran it on the rows read for training alone
        params.update(transformFn=RowTransformation(given["transformation_fn"]),
                      transformFnInference=untransformed)
    if given.get("gradient_compression") is not None:
        params["gradientCompression"] = compression_name(given["gradient_compression"])
    if "use_gpu" in given:  # Horovod's True means "where there are GPUs"; sparkring's True insists
        params["useGpu"] = None if given["use_gpu"] else False
    params.update(_from_backend(given.get("backend"), given.get("num_proc")))
    return params


def check_minibatch_fit(config: EstimatorConfig) -> None:
    """A train_minibatch_fn steps a whole model's optimizer on every rank (Horovod's one way of
    training): refused, naming the Param, with a sharded, model-parallel, elastic or Lightning fit."""
    others = {"strategy": config.strategy != "ddp", "tensorParallel": config.tensor_parallel != 1,
              "pipelineParallel": config.pipeline_parallel != 1, "minProc/checkpointEvery": config.elastic,
              "a LightningModule (its training_step is its step)": is_lightning_module(config.model)}
    for name, clashes in others.items():
        if clashes:
            raise ConfigurationError(f"train_minibatch_fn needs a model replicated on every rank (strategy='ddp', "
                                     f"not elastic); drop train_minibatch_fn or {name}")


def _from_backend(backend: Optional[Backend], num_proc: Optional[int]) -> Dict[str, Any]:
    if backend is None:
        return {}
    if num_proc is not None:
        raise ConfigurationError("TorchEstimator: give backend= or num_proc=, not both (as in Horovod)")
    params: Dict[str, Any] = {"numProc": int(backend.num_processes())}
    if isinstance(backend, SparkBackend) and backend.start_timeout is not None:
        params["startTimeout"] = backend.start_timeout
    elif not isinstance(backend, SparkBackend):
        log.info("backend=%r: sparkring launches %d ranks itself; the backend's run() is not called",
                 backend, params["numProc"])
    return params


class TorchModel(SparkRingModel):
    """Horovod's ``TorchModel``: the fitted model; ``transform()`` writes one ``<label>__output``
    column per label (``setOutputCols`` renames them): a vector where the model gives several values
    per row, else the label's own type.

    >>> model = TorchModel(model=net, feature_columns=["features"], label_columns=["y"],
    ...                    input_shapes=[[2]])  # doctest: +SKIP
    >>> model.transform(df).select("y__output")  # doctest: +SKIP
    """

    def __init__(self, history: Optional[Any] = None, model: Optional[Any] = None,
                 feature_columns: Optional[Sequence[str]] = None, input_shapes: Optional[Sequence[Any]] = None,
                 label_columns: Optional[Sequence[str]] = None, optimizer: Optional[Any] = None,
                 run_id: Optional[str] = None, _metadata: Optional[Any] = None, loss: Optional[Any] = None,
                 loss_constructors: Optional[List[Any]] = None):
        super().__init__()
        if history is not None:
            self.history = history
        params: Dict[str, Any] = {"model": model, "runId": run_id}
        params.update(model_inputs(feature_columns, input_shapes))
        if label_columns is not None:
            params["labelCol"] = list(label_columns)
            params["predictionCol"] = [f"{label}__output" for label in label_columns]
            params["loss"] = horovod_losses(loss, loss_constructors, len(label_columns), None)
        self._set(**{k: v for k, v in params.items() if v is not None})

    def getHistory(self) -> List[Dict[str, Any]]:
        """The fit's figures, one dict per epoch."""
        return self.history

    def setOutputCols(self, value: List[str]) -> "TorchModel":
        """Name the output columns, one per label (default ``<label>__output``)."""
        return self._set(predictionCol=list(value))

    def getOutputCols(self) -> List[str]:
        """The output columns, one per label."""
        return self.config().prediction_columns

    def getFeatureColumns(self) -> List[str]:
        """The feature columns."""
        return self.config().feature_columns

    def getLabelColumns(self) -> List[str]:
        """The label columns."""
        return self.config().label_columns

    def _transform(self, dataset):
        out = super()._transform(dataset)
        config = self.config()
        fields = {f.name: f.dataType for f in out.schema.fields}
        for label, column in zip(config.label_columns, config.prediction_columns):
            if isinstance(fields[column], T.ArrayType):
                out = out.withColumn(column, array_to_vector(F.col(column)))
            elif label in fields and isinstance(fields[label], T.NumericType):
                value = F.round(F.col(column)) if isinstance(fields[label], T.IntegralType) else F.col(column)
                out = out.withColumn(column, value.cast(fields[label]))
        return out


class TorchEstimator(SparkRingEstimator):
    """Horovod's ``horovod.spark.torch.TorchEstimator``: every Horovod keyword, translated into
    SparkRingEstimator's Params (``translate``); the rate scales with the number of processes as
    Horovod's does; ``fit()`` returns a TorchModel. A fit whose ``run_id`` already has checkpoints
    in the store resumes from them (``_load_checkpoint``).

    >>> est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
    ...                      loss=F.binary_cross_entropy, input_shapes=[[2]], feature_cols=["features"],
    ...                      label_cols=["y"], batch_size=4, epochs=3)  # doctest: +SKIP
    """

    fitted_type = TorchModel

    def __init__(self, num_proc=None, data_module=None, model=None, backend=None, store=None, optimizer=None,
                 loss=None, loss_constructors=None, metrics=None, loss_weights=None, sample_weight_col=None,
                 gradient_compression=None, feature_cols=None, continuous_cols=None, categorical_cols=None,
                 input_shapes=None, validation=None, label_cols=None, callbacks=None, batch_size=None,
                 val_batch_size=None, epochs=None, verbose=1, random_seed=None, shuffle_buffer_size=None,
                 shuffle=True, partitions_per_process=None, run_id=None, train_minibatch_fn=None,
                 train_steps_per_epoch=None, validation_steps_per_epoch=None, transformation_fn=None,
                 train_reader_num_workers=None, val_reader_num_workers=None, reader_pool_type="thread",
                 label_shapes=None, inmemory_cache_all=False, use_gpu=True, mp_start_method=None,
                 backward_passes_per_step=1):
        super().__init__()
        given = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self._label_shapes = label_shapes
        self._train_minibatch = train_minibatch_fn
        self._set(learningRateScaling="linear")  # Horovod's estimator scales the rate by the processes
        self._set(**translate(given))

    # -- Horovod's setters and getters where its names differ ------------------------
    def setLoss(self, value: Any) -> "TorchEstimator":
        """Horovod's setLoss: one loss (for every label) or one per label."""
        heads = len(self.config().label_columns)
        return self._set(loss=horovod_losses(value, None, heads, self._label_shapes))

    def setLossConstructors(self, value: List[Any]) -> "TorchEstimator":
        """Functions that each make a loss, one per label."""
        heads = len(self.config().label_columns)
        return self._set(loss=horovod_losses(None, value, heads, self._label_shapes))

    def setFeatureCols(self, value: List[str]) -> "TorchEstimator":
        """The feature columns, each one input of forward()."""
        return self._set(**model_inputs(value, None))

    def getFeatureCols(self) -> List[str]:
        """The feature columns."""
        return self.config().feature_columns

    def setLabelCols(self, value: List[str]) -> "TorchEstimator":
        """The label columns, one per output of the model."""
        return self._set(labelCol=list(value))

    def getLabelCols(self) -> List[str]:
        """The label columns."""
        return self.config().label_columns

    def setRandomSeed(self, value: int) -> "TorchEstimator":
        """The seed of the shuffle, the split and the initial weights."""
        return self._set(seed=value)

    def getRandomSeed(self) -> int:
        """The seed."""
        return self.config().seed

    def setBackend(self, value: Any) -> "TorchEstimator":
        """A Horovod Backend (its number of processes) or sparkring's backend name."""
        if isinstance(value, Backend):
            return self._set(**_from_backend(value, None))
        return self._set(backend=value)

    def setTrainMinibatchFn(self, value: Optional[Callable[..., Any]]) -> "TorchEstimator":
        """Horovod's train_minibatch_fn: the function that runs each training batch's step."""
        self._train_minibatch = value
        return self

    def getTrainMinibatchFn(self) -> Optional[Callable[..., Any]]:
        """The train_minibatch_fn given (None: sparkring's step)."""
        return self._train_minibatch

    def _fit_context(self, dataset) -> FitContext:
        context = super()._fit_context(dataset)
        if self._train_minibatch is None:
            return context
        check_minibatch_fit(context.config)
        return replace(context, train_minibatch=self._train_minibatch)

    def getRunId(self) -> Optional[str]:
        """The run's id in the store (None before a fit assigned one)."""
        return self.config().run_id

    def _load_checkpoint(self, run_id: str) -> Optional[str]:
        """Where a fit with ``run_id`` resumes: its newest checkpoint in the store, or None."""
        from ...trainer.checkpoints import resume_point

        config = self.config()
        store = config.store
        if store is None or not store.exists(store.checkpoint_path(run_id)):
            return None
        point = resume_point(store, run_id)
        log.info("run %s resumes from %s", run_id, point)
        return point

    def _resume_point(self, run_id: str) -> Optional[str]:
        """The one hook the fit asks where it resumes (Horovod's TorchEstimator: ``_load_checkpoint``)."""
        return self._load_checkpoint(run_id)

    def _fit(self, dataset):
        run_id = self.config().run_id
        if run_id is not None:
            self._resume_point(run_id)
        estimator, dataset = self._marked_validation(dataset)
        model = SparkRingEstimator._fit(estimator, dataset)
        model._set(predictionCol=[f"{label}__output" for label in model.config().label_columns])
        return model

    def _marked_validation(self, dataset):
        """Horovod's validation column may hold 1/0: marked as a boolean column for the estimator."""
        from ..common.util import VALIDATION_MARK

        validation = self.config().validation
        fields = {f.name: f.dataType for f in dataset.schema.fields}
        if not isinstance(validation, str) or not isinstance(fields.get(validation), T.NumericType):
            return self, dataset
        return (self.copy({self.getParam("validation"): VALIDATION_MARK}),
                dataset.withColumn(VALIDATION_MARK, F.col(validation).cast("boolean")))

    def fit_on_parquet(self, params: Optional[Dict[Any, Any]] = None, dataset_idx: Optional[Any] = None
                       ) -> TorchModel:
        """Fit on the Parquet that ``util.prepare_data`` wrote to the store (its training rows, and
        its validation rows where it wrote some).

        >>> with util.prepare_data(2, store, df, label_columns=["y"], feature_columns=["features"]):
        ...     model = est.fit_on_parquet()  # doctest: +SKIP
        """
        from ..common.util import VALIDATION_MARK, read_prepared

        estimator = self.copy(params or {})
        df = read_prepared(estimator.config().store, dataset_idx)
        if VALIDATION_MARK in df.columns:
            estimator._set(validation=VALIDATION_MARK)
        return estimator.fit(df)
