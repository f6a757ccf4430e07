"""pyspark.ml Params shared by SparkRingEstimator and SparkRingModel."""
from __future__ import annotations

from typing import Any, List, Union

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasLabelCol, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol, HasSeed


def _identity(value: Any) -> Any:
    return value


def _names_converter(what: str):
    """A converter to one column name or a non-empty list of them; ``what`` says what the list means."""
    def convert(value: Any) -> Union[str, List[str]]:
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
            return list(value)
        raise TypeError(f"{what}: give a column name or a non-empty list of names, got {value!r}")
    return convert


_to_columns = _names_converter("featuresCol")
_to_names = _names_converter("labelCol/predictionCol (one name per model head)")


def _to_model_inputs(value: Any):
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, (list, tuple)):
        return [v if isinstance(v, str) else list(v) for v in value]
    raise TypeError(f"modelInputs must be a list of columns (or column lists) or a dict name -> column(s), "
                    f"got {value!r}")


def _to_input_shapes(value: Any):
    if value is None or isinstance(value, dict):
        return None if value is None else {k: list(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return list(value)
    raise TypeError(f"inputShapes must be a shape (list of ints) or a dict input name -> shape, got {value!r}")


def _to_loss_weights(value: Any):
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [TypeConverters.toFloat(v) for v in value]
    raise TypeError(f"lossWeights must be a list of numbers, one per label, got {value!r}")


def _to_validation(value: Any) -> Union[None, float, str]:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise TypeError("validation must be a fraction in (0, 1) or a boolean column name, not a bool")
    return TypeConverters.toFloat(value)


def _to_optional_int(value: Any):
    return None if value is None else TypeConverters.toInt(value)


def _param(name: str, doc: str, converter=_identity) -> Param:
    return Param(Params._dummy(), name, doc, typeConverter=converter)


# Params whose values are Python objects: persisted with cloudpickle, not as JSON.
OBJECT_PARAMS = ("model", "optimizer", "loss", "metrics", "callbacks", "store", "earlyStopping", "transformFn",
                 "transformFnInference")


class SparkRingParams(HasLabelCol, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol, HasSeed):
    """Params of SparkRingEstimator (the model carries them too)."""

    model = _param("model", "the torch.nn.Module to train")
    optimizer = _param("optimizer", "a torch.optim.Optimizer over the model's parameters, or a factory "
                                    "params -> Optimizer")
    loss = _param("loss", "loss name (cross_entropy, nll, mse, l1, bce_with_logits, smooth_l1) or a "
                          "callable(output, label) -> scalar")
    metrics = _param("metrics", "callables (output, label) -> scalar (list or dict by name), averaged over ranks")
    featuresCol = _param("featuresCol", "a vector/array column, or a list of numeric columns", _to_columns)
    labelCol = _param("labelCol", "label column, or a list of them for a model with several heads", _to_names)
    predictionCol = _param("predictionCol", "prediction column, or one per head (a list as long as labelCol)",
                           _to_names)
    modelInputs = _param("modelInputs", "forward()'s arguments: a list of columns or column lists (positional) "
                                        "or a dict name -> column(s) (keyword); default: featuresCol as one "
                                        "tensor", _to_model_inputs)
    inputShapes = _param("inputShapes", "a row's shape per input (dict input name -> shape, or one shape for a "
                                        "single input), applied after transformFn", _to_input_shapes)
    transformFn = _param("transformFn", "transformFn(batch: dict) -> dict run on every batch before the model "
                                        "(e.g. decode image bytes); picklable")
    transformFnInference = _param("transformFnInference", "the transformFn transform() uses (default: "
                                                          "transformFn)")
    readerWorkers = _param("readerWorkers", "processes per rank that run transformFn ahead of the step "
                                            "(default: the cores per rank - 1, 1 to 4; 0 runs it inline)",
                           _to_optional_int)
    onNonFinite = _param("onNonFinite", "raise (TrainingError naming epoch, step and rank; the last good checkpoint "
                                        "is kept) | skip_step (every rank skips that update; history counts "
                                        "skipped_steps)", TypeConverters.toString)
    reader = _param("reader", "how ranks read the prepared data: 'arrow' (default, pyarrow) or 'petastorm' "
                              "(petastorm's make_batch_reader: the same rows and batches; Spark 3.5 only)",
                    TypeConverters.toString)
    lossWeights = _param("lossWeights", "weight of each head's loss in the total (default: 1 each)",
                         _to_loss_weights)
    sampleWeightCol = _param("sampleWeightCol", "column of per-row loss weights (optional)",
                             TypeConverters.toString)
    batchSize = _param("batchSize", "rows per rank per training step", TypeConverters.toInt)
    valBatchSize = _param("valBatchSize", "rows per validation batch (default: batchSize)", _to_optional_int)
    epochs = _param("epochs", "passes over the training data", TypeConverters.toInt)
    numProc = _param("numProc", "number of ranks (default: every task slot, or GPU)", _to_optional_int)
    validation = _param("validation", "fraction of rows held out, or a boolean column marking them",
                        _to_validation)
    shuffle = _param("shuffle", "shuffle training rows every epoch", TypeConverters.toBoolean)
    backend = _param("backend", "auto | gloo | nccl | mpi", TypeConverters.toString)
    useGpu = _param("useGpu", "train on GPUs (default: when Spark schedules GPUs)", _identity)
    store = _param("store", "sparkring.Store for data, checkpoints, logs (default: a temporary local one)")
    runId = _param("runId", "name of the run in the store; fitting again with the same runId resumes",
                   _identity)
    backwardPassesPerStep = _param("backwardPassesPerStep", "batches whose gradients add up before a step",
                                   TypeConverters.toInt)
    gradientCompression = _param("gradientCompression", "none | fp16", TypeConverters.toString)
    learningRateScaling = _param("learningRateScaling", "none | linear (lr x numProc)", TypeConverters.toString)
    warmupEpochs = _param("warmupEpochs", "epochs to ramp lr up to its scaled value", TypeConverters.toFloat)
    trainStepsPerEpoch = _param("trainStepsPerEpoch", "steps per epoch (default: one pass)", _to_optional_int)
    validationStepsPerEpoch = _param("validationStepsPerEpoch", "validation batches per epoch (default: all)",
                                     _to_optional_int)
    callbacks = _param("callbacks", "objects with on_train_begin/on_epoch_end/on_train_end, or callables "
                                    "(epoch, logs); they run on rank 0")
    earlyStopping = _param("earlyStopping", "patience (int) or dict(monitor, patience, mode, min_delta)")
    verbose = _param("verbose", "0 silent, 1 progress bar and epoch lines, 2 also every rank's output",
                     TypeConverters.toInt)
    inferenceBatchSize = _param("inferenceBatchSize", "rows per forward pass in transform", TypeConverters.toInt)
    keepData = _param("keepData", "keep the prepared Parquet after fit", TypeConverters.toBoolean)
    timeout = _param("timeout", "seconds before a rank is considered hung (default: none)", _identity)
    streamLogs = _param("streamLogs", "stream progress and rank output live to the driver; False (or executors "
                                      "that cannot reach it) prints the epoch lines when training ends",
                        TypeConverters.toBoolean)
    mlflowLogging = _param("mlflowLogging", "auto (log the fit into the active MLflow run, if any) | on (also start "
                                            "a run when none is active) | off", TypeConverters.toString)
    sharedMemory = _param("sharedMemory", "CPU gradient allreduce between ranks of one host through shared memory "
                                          "(/dev/shm); False sends it through gloo", TypeConverters.toBoolean)

    def __init__(self):
        super().__init__()
        self._setDefault(featuresCol="features", labelCol="label", predictionCol="prediction",
                         probabilityCol="probability", rawPredictionCol="rawPrediction", batchSize=32,
                         epochs=1, validation=None, shuffle=True, seed=0, backend="auto", useGpu=None,
                         store=None, runId=None, backwardPassesPerStep=1, gradientCompression="none",
                         learningRateScaling="none", warmupEpochs=0.0, trainStepsPerEpoch=None,
                         validationStepsPerEpoch=None, callbacks=None, earlyStopping=None, verbose=1,
                         inferenceBatchSize=1024, keepData=False, metrics=None, valBatchSize=None,
                         numProc=None, optimizer=None, loss=None, model=None, timeout=None,
                         streamLogs=True, modelInputs=None, inputShapes=None, transformFn=None,
                         transformFnInference=None, readerWorkers=None, lossWeights=None, onNonFinite="raise",
                         reader="arrow", sharedMemory=True, mlflowLogging="auto")

    def featureColumns(self) -> List[str]:
        cols = self.getOrDefault(self.featuresCol)
        return [cols] if isinstance(cols, str) else list(cols)

    def labelColumns(self) -> List[str]:
        """labelCol as a list (one entry per model head).

        >>> est.labelColumns()  # doctest: +SKIP
        ['rating', 'clicked']
        """
        cols = self.getOrDefault(self.labelCol)
        return [cols] if isinstance(cols, str) else list(cols)

    def lossList(self) -> List[Any]:
        """loss as a list, one per head (a single loss serves every head).

        >>> est.lossList()  # doctest: +SKIP
        ['mse', 'bce_with_logits']
        """
        loss = self.getOrDefault(self.loss)
        if isinstance(loss, (list, tuple)):
            return list(loss)
        return [loss] * len(self.labelColumns())

    def predictionColumns(self) -> List[str]:
        """predictionCol as a list: one per head (``<label>_prediction`` when several heads share a default).

        >>> est.predictionColumns()  # doctest: +SKIP
        ['rating_hat', 'click_hat']
        """
        pred = self.getOrDefault(self.predictionCol)
        labels = self.labelColumns()
        if isinstance(pred, str):
            return [pred] if len(labels) == 1 else [f"{label}_{pred}" for label in labels]
        return list(pred)


def _make_accessors(cls) -> None:
    """setX/getX for every Param, as pyspark.ml classes spell them."""
    for name in dir(cls):
        param = getattr(cls, name, None)
        if not isinstance(param, Param):
            continue
        cap = name[0].upper() + name[1:]
        if not hasattr(cls, "get" + cap):
            def getter(self, _n=name):
                return self.getOrDefault(_n)
            getter.__doc__ = f"Value of {name}.\n\n>>> est.get{cap}()  # doctest: +SKIP\n"
            setattr(cls, "get" + cap, getter)
        if not hasattr(cls, "set" + cap):
            def setter(self, value, _n=name):
                return self._set(**{_n: value})
            setter.__doc__ = f"Set {name}; returns self.\n\n>>> est.set{cap}(value)  # doctest: +SKIP\n"
            setattr(cls, "set" + cap, setter)


_make_accessors(SparkRingParams)
