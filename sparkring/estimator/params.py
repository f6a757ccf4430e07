"""pyspark.ml Params shared by SparkRingEstimator and SparkRingModel, declared once in one table
(PARAMS) from which the Params, defaults, constructor signature, value checks and README's
Param reference all come."""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasLabelCol, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol, HasSeed

from ..data import READERS
from ..errors import ConfigurationError
from ..runner.driver.plan import BACKENDS
from ..trainer.activation import MODES as ACTIVATION_MODES
from ..trainer.config import (
    COMPRESSIONS,
    LIGHTNING_BATCHES,
    LR_SCALINGS,
    ON_NON_FINITE,
    PIPELINE_SCHEDULES,
    PRECISIONS,
    STRATEGIES,
)
from .config import TASKS, EstimatorConfig
from .param_converters import (
    identity,
    to_columns,
    to_compile,
    to_input_shapes,
    to_loss_weights,
    to_model_inputs,
    to_names,
    to_optional_float,
    to_optional_int,
    to_optional_names,
    to_optional_string,
    to_resource_profile,
    to_validation,
)
from .text_inference import MODES as INFERENCE_MODES
from .tracking import MODES as MLFLOW_MODES


def _one_of(choices: Tuple[Any, ...]) -> str:
    """A choice Param's type as the signature and the reference show it: its allowed values.

    >>> _one_of(("ddp", "fsdp", None))
    "'ddp' | 'fsdp' | None"
    """
    return " | ".join(map(repr, choices))


@dataclass(frozen=True)
class ParamSpec:
    """One Param of SparkRingEstimator, declared once: its Param, default, place in the
    constructor's signature, the checks of its value made before any Spark job, and its row in
    README's Param reference."""

    name: str
    type: str                                 # as the signature and README show it
    default: Any
    doc: str
    converter: Callable[[Any], Any] = identity
    choices: Tuple[Optional[str], ...] = ()   # the allowed values of a string Param
    minimum: Optional[int] = None             # an int Param's least value (None also allowed if default is)
    is_object: bool = False                   # a Python object: persisted with cloudpickle, not JSON
    shared: bool = False                      # pyspark's own shared Param (HasSeed, HasProbabilityCol, ...)
    field: Optional[str] = None               # the TrainConfig field it fills as it is (train_config())

    @property
    def attr(self) -> str:
        """Its field of EstimatorConfig: the name in snake_case (``batchSize`` -> ``batch_size``)."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", self.name).lower()


PARAMS: Tuple[ParamSpec, ...] = (
    ParamSpec("model", "torch.nn.Module | Callable[[], Module] | str", None,
              "the torch.nn.Module (or LightningModule) to train, a zero-argument factory every rank calls to build "
              "it (under the meta device with a sharded strategy; its from_pretrained calls read each rank's share "
              "from storage), or a Hugging Face checkpoint directory (a path or Store URL)", is_object=True,
              field="model"),
    ParamSpec("initialWeights", "str | None", None, "a safetensors file or directory, a DCP checkpoint directory or "
              "a torch state-dict file (a path or Store URL) whose values every rank reads its share of into the "
              "model built", to_optional_string, field="initial_weights"),
    ParamSpec("optimizer", "Optimizer | Callable[[params], Optimizer]", None,
              "a torch.optim.Optimizer over the model's parameters, or a factory params -> Optimizer", is_object=True,
              field="optimizer"),
    ParamSpec("loss", "str | Callable | list", None,
              "loss name (cross_entropy, nll, mse, l1, bce_with_logits, smooth_l1) or a callable(output, label) -> "
              "scalar; a list gives one per head", is_object=True),
    ParamSpec("metrics", "list | dict | None", None,
              "'accuracy' or callables (output, label) -> scalar (list or dict by name), averaged over ranks",
              is_object=True),
    ParamSpec("featuresCol", "str | list[str]", "features", "a vector/array column, or a list of numeric columns",
              to_columns),
    ParamSpec("labelCol", "str | list[str]", "label", "label column, or a list of them for a model with several heads",
              to_names),
    ParamSpec("predictionCol", "str | list[str]", "prediction",
              "prediction column, or one per head (a list as long as labelCol)", to_names),
    ParamSpec("probabilityCol", "str", "probability", "class probabilities column (classifiers)", shared=True),
    ParamSpec("rawPredictionCol", "str", "rawPrediction", "raw model output column (classifiers)", shared=True),
    ParamSpec("sampleWeightCol", "str | None", None, "column of per-row loss weights (optional)",
              to_optional_string),
    ParamSpec("modelInputs", "list | dict | None", None,
              "forward()'s arguments: a list of columns or column lists (positional) or a dict name -> column(s) "
              "(keyword); default: featuresCol as one tensor", to_model_inputs),
    ParamSpec("inputShapes", "list[int] | dict | None", None,
              "a row's shape per input (dict input name -> shape, or one shape for a single input), applied after "
              "transformFn", to_input_shapes),
    ParamSpec("textCol", "str | None", None,
              "a string column of documents, tokenized on the executors with tokenizer (then task says what to "
              "train; featuresCol, labelCol and loss follow from it)", to_optional_string),
    ParamSpec("tokenizer", "tokenizers.Tokenizer | PreTrainedTokenizer | str | None", None,
              "textCol's tokenizer: a tokenizers.Tokenizer, a transformers tokenizer, or the local directory of one "
              "(never downloaded)", is_object=True),
    ParamSpec("sequenceLength", "int", 512, "tokens per training row of textCol", TypeConverters.toInt, minimum=2),
    ParamSpec("packSequences", "bool", True,
              "concatenate documents (each closed by end-of-sequence) and cut them to sequenceLength, position ids "
              "and a Hugging Face model's attention restarting per document (causal-lm only); False: one document "
              "per row, cut and padded", TypeConverters.toBoolean),
    ParamSpec("task", _one_of((None,) + TASKS), None,
              "what a textCol fit trains: causal-lm (next-token prediction, labels are the shifted inputs, padding "
              "ignored), sequence-classification (labelCol's class per document, one unpacked document per row) or "
              "masked-lm (an encoder fills in 15% of each document's tokens, hidden by seed; one unpacked document "
              "per row)", to_optional_string, choices=(None,) + TASKS),
    ParamSpec("lora", "peft.LoraConfig | None", None,
              "a textCol fit trains only LoRA adapters on the model (peft): the base weights stay frozen and are not "
              "exchanged; the fitted model keeps the adapters", is_object=True),
    ParamSpec("mergeAdapters", "bool", False, "saving a LoRA-fitted model folds the adapters into the base weights "
              "(a plain model, no peft needed to load it)", TypeConverters.toBoolean),
    ParamSpec("peakFlops", "float | None", None,
              "one rank's peak FLOP/s (e.g. 989e12 for an H100's bf16): a textCol fit's history then has mfu, "
              "6 x parameters x tokens/s over it", to_optional_float),
    ParamSpec("transformFn", "Callable[[dict], dict] | None", None,
              "transformFn(batch: dict) -> dict run on every batch before the model (e.g. decode image bytes); "
              "picklable", is_object=True, field="transform_fn"),
    ParamSpec("transformFnInference", "Callable[[dict], dict] | None", None,
              "the transformFn transform() uses (default: transformFn)", is_object=True),
    ParamSpec("readerWorkers", "int | None", None,
              "processes per rank that run transformFn ahead of the step (default: the cores per rank - 1, 1 to 4; "
              "0 runs it inline)", to_optional_int, minimum=0, field="reader_workers"),
    ParamSpec("batchSize", "int", 32, "rows per rank per training step", TypeConverters.toInt, minimum=1,
              field="batch_size"),
    ParamSpec("valBatchSize", "int | None", None, "rows per validation batch (default: batchSize)", to_optional_int,
              minimum=1),
    ParamSpec("epochs", "int", 1, "passes over the training data", TypeConverters.toInt, minimum=1, field="epochs"),
    ParamSpec("numProc", "int | None", None, "number of ranks (default: every task slot, or GPU)", to_optional_int),
    ParamSpec("validation", "float | str | None", None, "fraction of rows held out, or a boolean column marking them",
              to_validation),
    ParamSpec("shuffle", "bool", True, "shuffle training rows every epoch", TypeConverters.toBoolean, field="shuffle"),
    ParamSpec("seed", "int", 0, "seed of the shuffle, the validation split and the model's initial weights",
              shared=True, field="seed"),
    ParamSpec("backend", _one_of(BACKENDS), "auto",
              "how ranks reduce: auto (NCCL on whole GPUs, else gloo), gloo, nccl or mpi",
              TypeConverters.toString, choices=BACKENDS),
    ParamSpec("useGpu", "bool | None", None, "train on GPUs (default: when Spark schedules GPUs)"),
    ParamSpec("ranksPerTask", "int | None", None,
              "ranks each Spark task runs, one per GPU where it holds several (default: the task's whole GPUs, else "
              "1); numProc counts ranks", to_optional_int, minimum=1),
    ParamSpec("resourceProfile", "str | ResourceProfile", "auto",
              "the training stage's own task resources (stage-level scheduling): auto (asks for ranksPerTask GPUs "
              "per task where spark.task.resource.gpu.amount is less), off, or a pyspark ResourceProfile",
              to_resource_profile, is_object=True),
    ParamSpec("store", "Store | str | None", None,
              "sparkring.Store for data, checkpoints, logs (default: a temporary local one)", is_object=True),
    ParamSpec("runId", "str | None", None, "name of the run in the store; fitting again with the same runId resumes"),
    ParamSpec("strategy", _one_of(STRATEGIES), "ddp",
              "ddp (the model whole on every rank) | fsdp (FSDP2: parameters, gradients and "
              "optimizer state sharded across the ranks) | hsdp (sharded within each host, replicated across hosts)",
              TypeConverters.toString, choices=STRATEGIES),
    ParamSpec("fsdpWrap", "list[str] | None", None, "module class names sharded as units (default: every layer of "
              "the model's top-level children that holds parameters)", to_optional_names),
    ParamSpec("initFn", "Callable[[Module], None] | None", None, "initializes each module that holds parameters, at "
              "full size, after a factory-built model is sharded (default: its reset_parameters())", is_object=True),
    ParamSpec("cpuOffload", "bool", False, "with a sharded strategy, keep each rank's shards of parameters, "
              "gradients and optimizer state in CPU memory between uses (FSDP2's CPUOffloadPolicy; the optimizer "
              "steps on CPU): for models whose shards outgrow the GPU", TypeConverters.toBoolean),
    ParamSpec("asyncCheckpoint", "bool", False, "with a sharded strategy, write each checkpoint while training goes "
              "on (completed at the next one, or at the end)", TypeConverters.toBoolean),
    ParamSpec("tensorParallel", "int", 1, "ranks per tensor-parallel group (consecutive ranks of one host): each "
              "holds a slice of every planned layer (parallelizePlan) and the group reads the same rows; strategy "
              "acts across the groups (ddp replicates, fsdp shards); numProc / tensorParallel groups in all",
              TypeConverters.toInt, minimum=1),
    ParamSpec("parallelizePlan", "dict | Callable[[Module, DeviceMesh], Module] | None", None,
              "with tensorParallel > 1: module-name pattern -> 'colwise' | 'rowwise' | 'sequence' (or a torch "
              "ParallelStyle), or a callable (module, tp_mesh) -> module; default: torch's Transformer"
              "Encoder/DecoderLayer split their feed-forward block, Llama-style blocks q/k/v colwise, o rowwise, "
              "gate/up colwise, down rowwise", is_object=True),
    ParamSpec("pipelineParallel", "int", 1, "pipeline stages: each rank of a pipeline holds consecutive layers of the "
              "model (its stage) and passes microbatches on; the stages read the same rows; numProc / "
              "(pipelineParallel x tensorParallel) pipelines in all", TypeConverters.toInt, minimum=1),
    ParamSpec("pipelineSplit", "list[str] | None", None, "module names where stages 1, 2, ... begin: top-level "
              "children of an nn.Sequential (e.g. ['4']), or any module of another model (e.g. ['layers.2'], cut by "
              "torch's tracer); default: blocks balanced by parameter count", to_optional_names),
    ParamSpec("pipelineSchedule", _one_of(PIPELINE_SCHEDULES), "1f1b",
              "gpipe | 1f1b | interleaved-1f1b (two stages per rank): torch's "
              "pipeline schedules", TypeConverters.toString, choices=PIPELINE_SCHEDULES),
    ParamSpec("microbatches", "int | None", None, "microbatches per step with pipelineParallel > 1; must divide "
              "batchSize (default: pipelineParallel)", to_optional_int, minimum=1),
    ParamSpec("activationCheckpointing", _one_of(ACTIVATION_MODES), "none",
              "none | full (recompute every block's activations in "
              "backward instead of keeping them) | selective (every other block); blocks are fsdpWrap's units "
              "(default: every layer of the model's top-level children that holds parameters); any strategy",
              TypeConverters.toString, choices=ACTIVATION_MODES),
    ParamSpec("gradientClipNorm", "float | None", None, "clip the gradients' global 2-norm to this before each step "
              "(the norm over every rank's part: tensor-parallel slices, fsdp shards, pipeline stages; after "
              "16-mixed's unscaling)", to_optional_float, field="gradient_clip_norm"),
    ParamSpec("backwardPassesPerStep", "int", 1, "batches whose gradients add up before a step",
              TypeConverters.toInt, minimum=1, field="backward_passes_per_step"),
    ParamSpec("compile", "bool | dict", False, "torch.compile each rank's module (True, or a dict of torch.compile "
              "options, e.g. {'mode': 'max-autotune'}); the fitted model holds the module itself, not the compiled "
              "wrapper; the first (compiling) step's seconds go to the first epoch's first_step_seconds",
              to_compile),
    ParamSpec("gradientCompression", _one_of(COMPRESSIONS), "none",
              "none | fp16 | bf16: how gradients travel in the allreduce",
              TypeConverters.toString, choices=COMPRESSIONS, field="compression"),
    ParamSpec("precision", _one_of(PRECISIONS), "32",
              "32 | bf16-mixed | 16-mixed (Lightning's names): autocast forward and loss "
              "to bfloat16 or float16 on the rank's device; 16-mixed scales the loss (GradScaler) and skips a step "
              "whose reduced gradients overflow, on every rank alike; a sharded strategy keeps bfloat16 parameters "
              "for compute and reduces gradients in float32", TypeConverters.toString,
              choices=PRECISIONS, field="precision"),
    ParamSpec("learningRateScaling", _one_of(LR_SCALINGS), "none", "none | linear (lr x numProc)",
              TypeConverters.toString, choices=LR_SCALINGS, field="lr_scaling"),
    ParamSpec("warmupEpochs", "float", 0.0, "epochs to ramp lr up to its scaled value", TypeConverters.toFloat,
              field="warmup_epochs"),
    ParamSpec("trainStepsPerEpoch", "int | None", None, "steps per epoch (default: one pass)", to_optional_int,
              minimum=1),
    ParamSpec("validationStepsPerEpoch", "int | None", None, "validation batches per epoch (default: all)",
              to_optional_int, minimum=1),
    ParamSpec("callbacks", "list | None", None, "objects with on_train_begin/on_epoch_end/on_train_end, or callables "
              "(epoch, logs); they run on rank 0", is_object=True),
    ParamSpec("earlyStopping", "int | dict | None", None,
              "patience (int) or dict(monitor, patience, mode, min_delta)", is_object=True),
    ParamSpec("onNonFinite", _one_of(ON_NON_FINITE), "raise",
              "raise (TrainingError naming epoch, step and rank; the last good "
              "checkpoint is kept) | skip_step (every rank skips that update; history counts skipped_steps)",
              TypeConverters.toString, choices=ON_NON_FINITE),
    ParamSpec("lightningBatch", _one_of(LIGHTNING_BATCHES), "tuple",
              "what a LightningModule's training/validation_step gets: tuple (inputs..., labels...) or dict "
              "{column: tensor} (Horovod's)", TypeConverters.toString, choices=LIGHTNING_BATCHES,
              field="lightning_batch"),
    ParamSpec("reader", _one_of(READERS), "arrow", "how ranks read the prepared data: 'arrow' (pyarrow) or 'petastorm' "
              "(petastorm's make_batch_reader: the same rows and batches; Spark 3.5 only)", TypeConverters.toString,
              choices=READERS, field="reader"),
    ParamSpec("verbose", "int", 1, "0 silent, 1 progress bar and epoch lines, 2 also every rank's output",
              TypeConverters.toInt),
    ParamSpec("inference", _one_of(INFERENCE_MODES), "predict",
              "what transform() writes to predictionCol: predict (the model's outputs, as always) or, for a textCol "
              "model, generate (the continuation of each document), embed (the last hidden state mean-pooled), "
              "score (each row's loss and perplexity)", TypeConverters.toString, choices=INFERENCE_MODES),
    ParamSpec("generation", "dict | None", None,
              "inference='generate' settings passed to the model's generate() (default max_new_tokens=16, greedy; "
              "e.g. {'do_sample': True, 'temperature': 0.8, 'top_p': 0.9})", is_object=True),
    ParamSpec("inferenceBatchSize", "int", 1024, "rows per forward pass in transform", TypeConverters.toInt,
              minimum=1),
    ParamSpec("readInPlace", "bool", True, "when the DataFrame only scans local Parquet files (spark.read.parquet, "
              "columns selected at most) holding scalars, dense vectors or flat numeric arrays, and validation is "
              "not a column name, ranks read those files where they lie instead of a prepared copy (no prepare job); "
              "with False, the executors copy such files with pyarrow (docs/speed.md)",
              TypeConverters.toBoolean),
    ParamSpec("keepData", "bool", False, "keep the prepared Parquet after fit", TypeConverters.toBoolean),
    ParamSpec("timeout", "float | None", None, "seconds before a rank is considered hung (default: none)"),
    ParamSpec("timeline", "str | None", None, "write a Chrome-trace JSON of every rank's spans (start-up, data wait, "
              "forward, backward, each gradient allreduce with its bytes, optimizer step, checkpoint, validation) "
              "to this path on the driver; open it in Perfetto or chrome://tracing", to_optional_string),
    ParamSpec("startTimeout", "float", 120.0, "seconds the ranks have to start (and an elastic fit that lost ranks "
              "waits for minProc slots; with at least minProc it goes on at once)", TypeConverters.toFloat),
    ParamSpec("heartbeatTimeout", "float | None", 30.0, "seconds a running rank's task may send the driver nothing "
              "(each beats every few seconds from its own process, so a busy rank still beats) before its host counts "
              "as lost: the fit fails with HostLostError naming the ranks and the host, or an elastic fit goes on "
              "without them, whatever timeout says; None leaves a silent host to Spark's own heartbeat",
              to_optional_float),
    ParamSpec("minProc", "int | None", None, "elastic fit: when ranks are lost, go on with as few as this many "
              "(default: numProc, no shrinking); batches stay batchSize x numProc rows, so the result does not "
              "depend on how many ranks trained", to_optional_int, minimum=1),
    ParamSpec("checkpointEvery", "int | None", None, "elastic fit: also checkpoint every this many steps inside "
              "an epoch (default: at the end of each epoch only); a resumed run goes on at the next step",
              to_optional_int, minimum=1),
    ParamSpec("maxRestarts", "int", 3, "elastic fit: launches after the first one when ranks are lost",
              TypeConverters.toInt, minimum=0),
    ParamSpec("streamLogs", "bool", True, "stream progress and rank output live to the driver; False (or executors "
              "that cannot reach it) prints the epoch lines when training ends", TypeConverters.toBoolean),
    ParamSpec("sharedMemory", "bool", True, "CPU gradient allreduce between ranks of one host through shared memory "
              "(/dev/shm); False sends it through gloo", TypeConverters.toBoolean),
    ParamSpec("lossWeights", "list[float] | None", None, "weight of each head's loss in the total (default: 1 each)",
              to_loss_weights),
    ParamSpec("mlflowLogging", _one_of(MLFLOW_MODES), "auto",
              "auto (log the fit into the active MLflow run, if any) | on (also start "
              "a run when none is active) | off", TypeConverters.toString, choices=MLFLOW_MODES),
)
BY_NAME: Dict[str, ParamSpec] = {spec.name: spec for spec in PARAMS}
# Params whose values are Python objects: persisted with cloudpickle, not as JSON.
OBJECT_PARAMS = tuple(spec.name for spec in PARAMS if spec.is_object)


def check_values(values: Dict[str, Any]) -> None:
    """The checks the table declares (allowed values, least values), before any Spark job.

    >>> check_values({"gradientCompression": "int8"})
    Traceback (most recent call last):
    ...
    sparkring.errors.ConfigurationError: gradientCompression='int8': use one of 'none', 'fp16', 'bf16'
    """
    for name, value in values.items():
        spec = BY_NAME[name]
        if spec.choices and value not in spec.choices:
            raise ConfigurationError(f"{name}={value!r}: use one of {', '.join(map(repr, spec.choices))}")
        if spec.minimum is not None and value is not None and value < spec.minimum:
            unset = " (or unset)" if spec.default is None else ""
            raise ConfigurationError(f"{name}={value}: it must be at least {spec.minimum}{unset}")


def unknown_params(names) -> None:
    """A keyword the estimator does not know: TypeError naming it and the nearest Param."""
    import difflib

    for name in names:
        if name not in BY_NAME:
            near = difflib.get_close_matches(name, list(BY_NAME), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise TypeError(f"SparkRingEstimator has no Param {name!r}{hint}")


def signature(cls) -> inspect.Signature:
    """The keyword-only constructor signature the table describes (what help() and IDEs show)."""
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    parameters += [inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=spec.default,
                                     annotation=spec.type) for spec in PARAMS]
    return inspect.Signature(parameters, return_annotation=None)


def reference_markdown() -> str:
    """README's Param reference, generated from the table.

    >>> reference_markdown().splitlines()[0]
    '| Param | type | default | what it does |'
    """
    rows = ["| Param | type | default | what it does |", "|---|---|---|---|"]
    for spec in PARAMS:
        doc = spec.doc.replace("|", "\\|")
        kind = spec.type.replace("|", "\\|")
        rows.append(f"| `{spec.name}` | {kind} | `{spec.default!r}` | {doc} |")
    return "\n".join(rows)


class SparkRingParams(HasLabelCol, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol, HasSeed):
    """Params of SparkRingEstimator (the model carries them too), declared by PARAMS."""
    model: Param  # set by _declare, as every Param of the table; named here for the model's getModel()

    def __init__(self):
        super().__init__()
        self._setDefault(**{spec.name: spec.default for spec in PARAMS})

    def paramValues(self) -> Dict[str, Any]:
        """Every Param's value (set or default), read once, by name.

        >>> SparkRingParams().paramValues()["batchSize"]
        32
        """
        return {spec.name: self.getOrDefault(spec.name) for spec in PARAMS}

    def config(self) -> EstimatorConfig:
        """Every Param's value as one typed EstimatorConfig, after the table's checks (allowed values,
        least values): what fit(), transform() and the Tuner read.

        >>> SparkRingParams().config().batch_size
        32
        """
        values = self.paramValues()
        check_values(values)
        return EstimatorConfig(**{spec.attr: values[spec.name] for spec in PARAMS})

    def _set_config(self, config: EstimatorConfig) -> None:
        """Set every Param whose value in ``config`` is not the one held (a text fit's token columns)."""
        changed = {spec.name: getattr(config, spec.attr) for spec in PARAMS
                   if getattr(config, spec.attr) is not self.getOrDefault(spec.name)}
        self._set(**changed)

    def featureColumns(self) -> List[str]:
        """featuresCol as a list.

        >>> SparkRingParams().featureColumns()
        ['features']
        """
        return self.config().feature_columns

    def labelColumns(self) -> List[str]:
        """labelCol as a list (one entry per model head).

        >>> est.labelColumns()  # doctest: +SKIP
        ['rating', 'clicked']
        """
        return self.config().label_columns

    def lossList(self) -> List[Any]:
        """loss as a list, one per head (a single loss serves every head).

        >>> est.lossList()  # doctest: +SKIP
        ['mse', 'bce_with_logits']
        """
        return self.config().losses

    def predictionColumns(self) -> List[str]:
        """predictionCol as a list: one per head (``<label>_prediction`` when several heads share a default).

        >>> est.predictionColumns()  # doctest: +SKIP
        ['rating_hat', 'click_hat']
        """
        return self.config().prediction_columns


def param_values(config: EstimatorConfig) -> Dict[str, Any]:
    """``config`` as Param name -> value (what MLflow logs as the fit's params).

    >>> param_values(SparkRingParams().config())["batchSize"]
    32
    """
    return {spec.name: getattr(config, spec.attr) for spec in PARAMS}


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


def _declare(cls) -> None:
    """A Param attribute for every row of PARAMS (pyspark's shared ones are inherited)."""
    for spec in PARAMS:
        if not spec.shared:
            setattr(cls, spec.name, Param(Params._dummy(), spec.name, spec.doc, typeConverter=spec.converter))


_declare(SparkRingParams)
_make_accessors(SparkRingParams)
