"""The checks fit() makes before any Spark job, and what they decide (FitDecisions): the model,
optimizer, losses and Params, the DataFrame's columns, what a sharded or elastic fit can run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..collective.hosting import transport
from ..data import DataError, FeatureSpec, Store, check_reader, petastorm_codecs
from ..data.store import check_run_id
from ..runner import (
    ESTIMATOR_NAMES,
    ConfigurationError,
    LaunchPlan,
    LaunchRequest,
    check_picklable,
    check_timeouts,
    plan_for,
)
from ..trainer import EarlyStopping, decoder_stages, fsdp, losses, pipeline, pretrained, tensor_parallel
from ..trainer.elastic import ElasticPlan
from ..trainer.lightning import check_module as lightning_problem
from ..trainer.lightning import is_lightning_module
from ..trainer.stored import StoredWeightsError
from . import tracking
from .config import EstimatorConfig
from .input_layer import check_input_layer
from .params import OBJECT_PARAMS, param_values


@dataclass(frozen=True)
class FitDecisions:
    """What the checks before any Spark job decided, for fit() to go on with."""

    metrics: Dict[str, Any]
    early_stopping: Optional[EarlyStopping]
    plan: LaunchPlan
    store: Store
    spec: FeatureSpec
    lightning: bool  # the model is a LightningModule (decided once, from the model's shape)
    shape: Optional[torch.nn.Module] = None  # the model as model_shape() built it (meta where a factory's)

    def check_input_layer(self, spec: FeatureSpec) -> None:
        """The model's input layer against the prepared data's measured widths (a Vector column's
        width is known only once prepare has read it)."""
        if self.shape is not None and not self.lightning:
            check_input_layer(self.shape, spec)


def fit_store(config: EstimatorConfig) -> Store:
    """The Store a fit keeps its data and checkpoints in: the ``store`` Param's (a Store or a URL),
    else a temporary local one.

    >>> fit_store(SparkRingEstimator(store="/tmp/runs").config()).url  # doctest: +SKIP
    '/tmp/runs'
    """
    store = config.store or Store()
    return store if isinstance(store, Store) else Store(str(store))


def decide(config: EstimatorConfig, df) -> FitDecisions:
    """Every check that needs no Spark job, with the facts fit() goes on with (the model factory
    runs here once, under the meta device).

    >>> decide(estimator.config(), df).lightning  # doctest: +SKIP
    False
    """
    shape = model_shape(config)
    lightning, metrics = check_training(config, shape)
    spec = check_columns(config, df)
    if not lightning:
        check_input_layer(shape, spec)
    validation = config.validation
    es = early_stopping(config, validation is not None, metrics, lightning)
    launch_plan = plan_launch(config, df.sparkSession, config.num_proc)
    check_sharding(config, launch_plan, lightning, shape)
    check_model_parallel(config, launch_plan, lightning, shape)
    check_elastic(config, launch_plan, lightning)
    if config.run_id is not None:
        check_run_id(config.run_id)
    store = fit_store(config)
    if store.is_temporary and not launch_plan.facts.single_host:
        raise ConfigurationError("store is not set and this is a cluster: ranks on other hosts cannot read "
                                 "a temporary local directory; pass store=Store('hdfs://...' or 's3://...')")
    store.check_writable()
    return FitDecisions(metrics=metrics, early_stopping=es, plan=launch_plan, store=store, spec=spec,
                        lightning=lightning, shape=shape)


def model_shape(config: EstimatorConfig) -> torch.nn.Module:
    """The model Param as a module: itself, or what its factory builds under the meta device
    (no memory, no RNG; its from_pretrained calls read the config only), which every check before
    the Spark job looks at; stored values are checked against it by name and shape (headers only)."""
    model = config.model_or_factory
    if isinstance(model, torch.nn.Module):
        stored = pretrained.stored_model(model, config.initial_weights, config.storage_options)
    elif not callable(model):
        raise ConfigurationError(f"model must be a torch.nn.Module, a zero-argument factory returning one or a "
                                 f"Hugging Face checkpoint directory, got {type(model).__name__}: pass "
                                 "model=<your nn.Module> or model=lambda: MyNet()")
    else:
        stored = _empty_model(config, model)
    try:
        if stored is not None:
            pretrained.matches(stored)
    except StoredWeightsError as exc:
        raise ConfigurationError(str(exc)) from None
    built = stored.module if stored is not None else model
    if not isinstance(built, torch.nn.Module):
        raise ConfigurationError(f"the model factory returned {type(built).__name__}, not a torch.nn.Module")
    return built


def _empty_model(config: EstimatorConfig, factory: Any) -> pretrained.StoredModel:
    try:
        return pretrained.empty_model(factory, config.initial_weights, config.storage_options)
    except StoredWeightsError as exc:
        if isinstance(config.model, str):
            raise ConfigurationError(f"model={config.model!r} is not a torch.nn.Module or a zero-argument factory, "
                                     f"so it must be a Hugging Face checkpoint directory: {exc}") from None
        raise ConfigurationError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - the user's factory: say how to fix it
        raise ConfigurationError(
            f"the model factory fails under torch.device('meta') ({type(exc).__name__}: {exc}); build only the "
            "modules in it and initialize their values in initFn=lambda module: ..., which runs at full size "
            "after sharding") from exc


def plan_launch(config: EstimatorConfig, spark, num_proc: Optional[int]) -> LaunchPlan:
    """The launch the estimator's Params ask for on this session (refused where it cannot run)."""
    return plan_for(spark, LaunchRequest(num_proc=num_proc, use_gpu=config.use_gpu, backend=config.backend,
                                         stream=config.stream_logs, names=ESTIMATOR_NAMES,
                                         shared_memory=config.shared_memory, registration_wait=config.start_timeout,
                                         ranks_per_task=config.ranks_per_task,
                                         resource_profile=config.resource_profile, min_proc=config.min_proc))


def elastic_plan(config: EstimatorConfig, num_proc: int) -> Optional[ElasticPlan]:
    """The elastic plan where minProc or checkpointEvery asks for one (None: a plain fit)."""
    if not config.elastic:
        return None
    # the rows of a step are read by the data-parallel ranks only (a model group reads the same ones)
    return ElasticPlan(global_batch=config.batch_size * config.model_parallel.data_size(num_proc),
                       target_size=num_proc, min_size=num_proc if config.min_proc is None else config.min_proc,
                       checkpoint_every=config.checkpoint_every)


def check_elastic(config: EstimatorConfig, launch_plan: LaunchPlan, lightning: bool) -> None:
    """What an elastic fit cannot run, refused before any Spark job."""
    min_proc = config.min_proc
    if min_proc is not None and min_proc > launch_plan.num_proc:
        raise ConfigurationError(f"minProc={min_proc} is more than numProc={launch_plan.num_proc}: the fit starts "
                                 "with numProc ranks and may go on with as few as minProc; lower minProc")
    if min_proc is not None and min_proc % launch_plan.ranks_per_task:
        raise ConfigurationError(f"minProc={min_proc} is not a multiple of ranksPerTask={launch_plan.ranks_per_task}: "
                                 "a lost task takes all its ranks with it")
    if elastic_plan(config, launch_plan.num_proc) is None:
        return
    what = "minProc" if min_proc is not None else "checkpointEvery"
    if lightning:
        raise ConfigurationError(f"{what} (an elastic fit) does not train a LightningModule yet; drop {what}")
    if config.backward_passes_per_step != 1:
        raise ConfigurationError(f"{what} (an elastic fit) steps on every global batch: drop "
                                 "backwardPassesPerStep (or raise batchSize instead)")


def check_sharding(config: EstimatorConfig, launch_plan: LaunchPlan, lightning: bool,
                   shape: torch.nn.Module) -> None:
    """What a sharded strategy cannot run, refused before any Spark job."""
    strategy = config.strategy
    if strategy == "ddp":
        for sharded_only, given in (("cpuOffload", config.cpu_offload), ("asyncCheckpoint", config.async_checkpoint)):
            if given:
                raise ConfigurationError(f"{sharded_only}=True applies to a sharded model: set strategy='fsdp' "
                                         f"(or 'hsdp'), or drop {sharded_only}")
        return
    if not transport(launch_plan.backend).torch_distributed:
        raise ConfigurationError(f"strategy={strategy!r} needs torch.distributed collectives (DTensor, FSDP2): "
                                 "use backend='gloo' or 'nccl', or strategy='ddp' with backend='mpi'")
    if strategy == "hsdp" and launch_plan.facts.single_host:
        raise ConfigurationError("strategy='hsdp' shards within a host and replicates across hosts, but every "
                                 "rank runs on one host: there it is strategy='fsdp'")
    if lightning:
        raise ConfigurationError(f"strategy={strategy!r} does not train a LightningModule yet: use strategy='ddp'")
    if isinstance(config.optimizer, torch.optim.Optimizer):
        raise ConfigurationError(f"strategy={strategy!r} builds the optimizer over each rank's shards: pass "
                                 "optimizer= as a factory, e.g. optimizer=lambda params: torch.optim.Adam(params)")
    sparse = [name for name, m in shape.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ConfigurationError(f"strategy={strategy!r} shards parameters, which sparse gradients cannot be: "
                                 f"module(s) {sparse} use sparse=True; drop it or use strategy='ddp'")
    _check_unit_dtypes(config, shape)
    if config.precision == "16-mixed":
        raise ConfigurationError(f"precision='16-mixed' scales the loss for replicated gradients; with "
                                 f"strategy={strategy!r} use precision='bf16-mixed' (FSDP2 computes in bfloat16 "
                                 "and reduces in float32)")
    if config.gradient_compression != "none":
        raise ConfigurationError(f"gradientCompression applies to strategy='ddp'; with {strategy!r} FSDP2 "
                                 "reduce-scatters gradients in their own dtype")


def _check_unit_dtypes(config: EstimatorConfig, shape: torch.nn.Module) -> None:
    """Each sharded unit's trainable parameters in one dtype, else the first unit mixing them named (LoRA: no check)."""
    for unit, dtypes in ({} if config.lora else fsdp.mixed_dtype_units(shape, tuple(config.fsdp_wrap or ()))).items():
        raise ConfigurationError(
            f"strategy={config.strategy!r} shards {repr(unit) if unit else 'the model itself'} as one unit, whose "
            f"trainable parameters hold {len(dtypes)} dtypes ({ {d: n[:3] for d, n in dtypes.items()} }): FSDP2 "
            "refuses that; build the model in one dtype (.to(torch.float32) in the factory, or from_pretrained(..., "
            "torch_dtype=torch.float32)), or name each dtype's modules in fsdpWrap so each is a unit of its own")


def check_model_parallel(config: EstimatorConfig, launch_plan: LaunchPlan, lightning: bool,
                         shape: torch.nn.Module) -> None:
    """What tensor and pipeline parallelism cannot run, refused before any Spark job, naming the
    Param and the fix."""
    tp, pp = config.tensor_parallel, config.pipeline_parallel
    for param, given, needs, degree in (("parallelizePlan", config.parallelize_plan, "tensorParallel", tp),
                                        ("pipelineSplit", config.pipeline_split, "pipelineParallel", pp),
                                        ("microbatches", config.microbatches, "pipelineParallel", pp)):
        if given is not None and degree == 1:
            raise ConfigurationError(f"{param} applies with {needs} > 1: set {needs} or drop {param}")
    if tp == 1 and pp == 1:
        return
    what = " x ".join(f"{name}={value}" for name, value in (("tensorParallel", tp), ("pipelineParallel", pp))
                      if value > 1)
    for refused, why in _model_parallel_refusals(config, lightning, shape):
        if refused:
            raise ConfigurationError(f"{what} {why}")
    num_proc, group = launch_plan.num_proc, config.model_parallel.group_size
    if num_proc % group:
        raise ConfigurationError(f"{what} does not divide numProc={num_proc}: numProc must be a multiple of "
                                 f"{group} (e.g. numProc={max(group, num_proc - num_proc % group)})")
    if not transport(launch_plan.backend).torch_distributed:
        raise ConfigurationError(f"{what} needs torch.distributed collectives (DTensor, point-to-point sends): use "
                                 "backend='gloo' or 'nccl', not 'mpi'")
    if tp > 1 and not callable(config.parallelize_plan):
        _check_plan(config.parallelize_plan, shape, strict=pp == 1)
    if pp > 1:
        check_pipeline(config, shape)
    if elastic_plan(config, num_proc) is not None:
        _check_elastic_groups(config, launch_plan, what)


def _check_elastic_groups(config: EstimatorConfig, launch_plan: LaunchPlan, what: str) -> None:
    """An elastic fit loses and regains whole model groups (tp x pp ranks): dp is what changes."""
    tp, pp, num_proc = config.tensor_parallel, config.pipeline_parallel, launch_plan.num_proc
    group, min_proc = config.model_parallel.group_size, config.min_proc or num_proc
    if min_proc % group:
        raise ConfigurationError(f"minProc={min_proc} is not a multiple of {what} ({group} ranks train one replica "
                                 "together and are lost together): use "
                                 f"minProc={max(group, min_proc - min_proc % group)}")
    if tp > 1 and not launch_plan.facts.single_host and launch_plan.ranks_per_task % tp:
        raise ConfigurationError(
            f"an elastic fit with tensorParallel={tp} across hosts keeps each tensor-parallel group inside one task, "
            f"so that a lost executor takes whole groups with it: set ranksPerTask to a multiple of {tp} (a task "
            f"of {tp} GPUs), or drop minProc/checkpointEvery")
    if pp == 1:
        return
    global_batch = config.batch_size * (num_proc // group)
    micro = config.microbatches or pp
    for dp in range(min_proc // group, num_proc // group + 1):
        share, rest = divmod(global_batch, dp)
        if rest or share % micro:
            raise ConfigurationError(
                f"an elastic pipelined fit splits each global batch of {global_batch} rows (batchSize x "
                f"{num_proc // group} data-parallel ranks) evenly over the data-parallel ranks there are, in "
                f"microbatches={micro}; with {dp} of them a share is {global_batch / dp:g} rows: choose a "
                f"batchSize whose global batch divides by every size from minProc to numProc, in whole microbatches")


def _model_parallel_refusals(config: EstimatorConfig, lightning: bool,
                             shape: torch.nn.Module) -> List[Tuple[bool, str]]:
    tp, pp = config.tensor_parallel, config.pipeline_parallel
    return [
        (tp > 1 and pp > 1 and not isinstance(shape, torch.nn.Sequential),
         "needs an nn.Sequential model (its stages keep their modules; torch's tracer, which cuts other models, turns "
         "them into InterpreterModules that tensor parallelism cannot split)"),
        (lightning, "does not train a LightningModule yet: drop it"),
        (config.strategy == "hsdp", "acts with strategy='ddp' or 'fsdp' across the groups, not 'hsdp'"),
        (isinstance(config.optimizer, torch.optim.Optimizer),
         "builds the optimizer over each rank's part of the model: pass optimizer= as a factory, e.g. "
         "optimizer=lambda params: torch.optim.Adam(params)"),
        (config.precision == "16-mixed", "does not scale float16 losses: use precision='bf16-mixed'"),
        (config.gradient_compression != "none", "exchanges gradients in their own dtype: drop "
                                                            "gradientCompression"),
        (config.backward_passes_per_step != 1, "steps after every batch: drop backwardPassesPerStep"),
        (pp > 1 and len(config.label_columns) > 1, "trains one head: pass one labelCol"),
        (pp > 1 and config.sample_weight_col is not None, "does not weight rows: drop sampleWeightCol"),
    ]


def _check_plan(plan, shape: torch.nn.Module, strict: bool) -> None:
    try:
        tensor_parallel.resolve_plan(shape, plan if plan is not None else tensor_parallel.default_plan(shape), strict)
    except tensor_parallel.PlanError as exc:
        raise ConfigurationError(str(exc)) from None


def check_pipeline(config: EstimatorConfig, shape: torch.nn.Module) -> None:
    """The stages, split points and microbatches of a pipeline, checked against the model and batch."""
    parallel = config.model_parallel
    split = parallel.pipeline_split
    if split and len(split) + 1 != parallel.stages:
        per_rank = f" ({parallel.stages_per_rank} stages per rank with {parallel.schedule})" \
            if parallel.stages_per_rank > 1 else ""
        raise ConfigurationError(f"pipelineParallel={parallel.pipeline_parallel} makes {parallel.stages} stages"
                                 f"{per_rank}, which begin at {parallel.stages - 1} split point(s), but pipelineSplit "
                                 f"names {len(split)}: {list(split)}")
    refused = decoder_stages.refusal(shape)
    if refused:
        raise ConfigurationError(f"pipelineParallel={parallel.pipeline_parallel} {refused}")
    if split and decoder_stages.cuts(shape):
        try:
            decoder_stages.layer_ranges(shape, list(split), parallel.stages)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
    names = dict(shape.named_children() if isinstance(shape, torch.nn.Sequential) else shape.named_modules())
    unknown = [name for name in split if name not in names]
    if unknown:
        raise ConfigurationError(f"pipelineSplit names module(s) the model does not have: {unknown}; "
                                 f"{pipeline.SEQUENTIAL_HINT}")
    if not split:
        try:
            pipeline.balanced_split(shape, parallel.stages, tuple(config.fsdp_wrap or ()))
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
    batch, micro = config.batch_size, parallel.microbatch_count
    if batch % micro:
        raise ConfigurationError(f"microbatches={micro} does not divide batchSize={batch}: each microbatch must "
                                 f"have as many rows (e.g. batchSize={batch - batch % micro or micro})")
    if parallel.schedule == "interleaved-1f1b" and micro % parallel.pipeline_parallel:
        raise ConfigurationError(f"pipelineSchedule='interleaved-1f1b' runs microbatches in rounds of "
                                 f"pipelineParallel={parallel.pipeline_parallel}: microbatches={micro} must be a "
                                 "multiple of it")


def check_training(config: EstimatorConfig, model: torch.nn.Module) -> Tuple[bool, Dict[str, Any]]:
    """The model, optimizer, losses, metrics and Param values; (is a LightningModule, metrics)."""
    lightning = is_lightning_module(model)
    if lightning:
        check_lightning_module(config, model)
    else:
        opt = config.optimizer
        if opt is None or not (isinstance(opt, torch.optim.Optimizer) or callable(opt)):
            raise ConfigurationError("optimizer must be a torch.optim.Optimizer over model.parameters() or a "
                                     "factory, e.g. optimizer=lambda params: torch.optim.Adam(params, lr=1e-3)")
    check_timeouts(config.timeout, None, ESTIMATOR_NAMES, config.heartbeat_timeout)
    clip = config.gradient_clip_norm
    if clip is not None and not clip > 0:
        raise ConfigurationError(f"gradientClipNorm={clip}: give a positive norm (e.g. 1.0), or leave it unset")
    # what ships to the ranks, checked here so that a lock or an open file in the model
    # is named before the data is written
    values = param_values(config)
    check_picklable({name: values[name] for name in OBJECT_PARAMS if values[name] is not None})
    labels = config.label_columns
    loss_list = config.losses
    if not lightning and any(loss is None for loss in loss_list):
        raise ConfigurationError("loss is not set: pass loss='cross_entropy' (or mse, nll, l1, "
                                 "bce_with_logits, smooth_l1) or a callable(output, label)")
    if len(loss_list) != len(labels):
        raise ConfigurationError(f"loss has {len(loss_list)} entries but labelCol names {len(labels)} labels "
                                 f"({labels}): give one loss per label")
    if len(set(labels)) != len(labels):
        raise ConfigurationError(f"labelCol names a column twice: {labels}")
    weights = config.loss_weights
    if weights is not None and len(weights) != len(labels):
        raise ConfigurationError(f"lossWeights has {len(weights)} entries but labelCol names {len(labels)} "
                                 "labels: give one weight per label")
    if len(config.prediction_columns) != len(labels):
        raise ConfigurationError(f"predictionCol names {len(config.prediction_columns)} columns but labelCol "
                                 f"names {len(labels)} labels: give one prediction column per label")
    try:
        for loss in loss_list if not lightning else []:
            losses.check_loss(loss)
        metrics = losses.metric_fns(config.metrics)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    for name, fn in (("transformFn", config.transform_fn), ("transformFnInference", config.transform_fn_inference)):
        if fn is not None and not callable(fn):
            raise ConfigurationError(f"{name} must be a callable(batch: dict) -> dict, got {type(fn).__name__}")
    check_reader(config.reader)
    tracking.check_mode(config.mlflow_logging)
    return lightning, metrics


def check_columns(config: EstimatorConfig, df) -> FeatureSpec:
    """The columns the Params name exist and have usable types; the FeatureSpec they make."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    labels, loss_list = config.label_columns, config.losses
    fields = {f.name: f.dataType for f in df.schema.fields}
    transform_fn = config.transform_fn
    if config.model_inputs is None and transform_fn is None:
        for c in config.feature_columns:
            if c not in fields:
                raise ConfigurationError(f"featuresCol {c!r} is not a column of the DataFrame; it has "
                                         f"{df.columns}. Set featuresCol= (a vector column or a list of columns)")
            dt = fields[c]
            ok = isinstance(dt, (VectorUDT, T.NumericType)) or (
                isinstance(dt, T.ArrayType) and isinstance(dt.elementType, (T.NumericType, T.ArrayType)))
            if not ok:
                raise ConfigurationError(f"featuresCol {c!r} has type {dt.simpleString()}; features must be a "
                                         "vector, a numeric array or numeric columns (use VectorAssembler)")
    for label in labels:
        if label not in fields:
            raise ConfigurationError(f"labelCol {label!r} is not a column of the DataFrame; it has "
                                     f"{df.columns}")
        if not isinstance(fields[label], (T.NumericType, T.BooleanType, VectorUDT, T.ArrayType)):
            raise ConfigurationError(f"labelCol {label!r} has type {fields[label].simpleString()}; it must be "
                                     "numeric (index string labels with StringIndexer)")
    weight = config.sample_weight_col
    if weight is not None:
        if weight not in fields or not isinstance(fields[weight], T.NumericType):
            raise ConfigurationError(f"sampleWeightCol {weight!r} must be a numeric column of the DataFrame")
        if not all(isinstance(loss, str) or losses.takes_sample_weight(loss) for loss in loss_list):
            raise ConfigurationError("sampleWeightCol needs a named loss, or a callable loss that takes the rows' "
                                     "weights itself: loss(output, label, sample_weight=None)")
    try:
        spec = FeatureSpec.build(df.schema, inputs=config.model_inputs,
                                 features=config.feature_columns, labels=labels, weight=weight,
                                 shapes=config.input_shapes, transform=transform_fn is not None,
                                 codecs=petastorm_codecs(df))
    except DataError as exc:
        raise ConfigurationError(str(exc)) from None
    validation = config.validation
    if isinstance(validation, str):
        if validation not in fields or not isinstance(fields[validation], T.BooleanType):
            raise ConfigurationError(f"validation={validation!r} must name a boolean column of the DataFrame")
    elif validation is not None and not 0 < validation < 1:
        raise ConfigurationError(f"validation={validation}: give a fraction strictly between 0 and 1 "
                                 "or the name of a boolean column")
    return spec


def check_lightning_module(config: EstimatorConfig, module: torch.nn.Module) -> None:
    """A LightningModule decides its optimizer, loss and metrics itself: the Params that would
    decide them too are refused rather than silently ignored."""
    problem = lightning_problem(module)
    if problem is not None:
        raise ConfigurationError(problem)
    given = [name for name, value in (("optimizer", config.optimizer), ("loss", config.loss),
                                      ("metrics", config.metrics), ("lossWeights", config.loss_weights))
             if value is not None]
    if given:
        raise ConfigurationError(f"model is a LightningModule, which decides {', '.join(given)} itself "
                                 "(configure_optimizers: optimizer and LR schedulers; training_step: the loss; "
                                 "est.log: metrics): drop " + ", ".join(f"{name}=" for name in given))


def early_stopping(config: EstimatorConfig, has_val: bool, metrics,
                   lightning: bool = False) -> Optional[EarlyStopping]:
    """The earlyStopping Param checked against the figures an epoch reports (None: no early stopping)."""
    es = config.early_stopping
    if es is None:
        return None
    if isinstance(es, int):
        es = {"patience": es}
    if not isinstance(es, dict) or "patience" not in es:
        raise ConfigurationError("earlyStopping must be a patience (int) or a dict with 'patience' "
                                 "(and optional 'monitor', 'mode', 'min_delta')")
    monitor = es.get("monitor", "val_loss" if has_val else "loss")
    known = ["loss"] + list(metrics)
    if len(config.label_columns) > 1:
        known += [f"{label}_{name}" for label in config.label_columns for name in ["loss"] + list(metrics)]
    known += [f"val_{k}" for k in known] if has_val else []
    # a LightningModule's figures are what it logs: checked when the first epoch ends
    if monitor not in known and not lightning:
        raise ConfigurationError(f"earlyStopping monitors {monitor!r}, which no epoch reports; use one of {known}")
    mode = es.get("mode", "max" if "acc" in monitor else "min")
    if mode not in ("min", "max"):
        raise ConfigurationError(f"earlyStopping mode={mode!r}: use 'min' or 'max'")
    return EarlyStopping(monitor=monitor, patience=int(es["patience"]), mode=mode,
                         min_delta=float(es.get("min_delta", 0.0)))


def class_labels(config: EstimatorConfig) -> List[Tuple[str, Any]]:
    """(label column, loss) of each head whose loss takes class indices."""
    return [(label, loss) for label, loss in zip(config.label_columns, config.losses)
            if losses.label_kind(loss) == "class"]


def check_labels(config: EstimatorConfig, ds) -> None:
    """Class-index losses need integral, non-negative labels: checked against what prepare saw
    of them in its pass over the DataFrame (no pass of their own). A boolean label is always
    a class index; an array label's values meet the loss on the ranks."""
    for label, loss in class_labels(config):
        values = ds.values(label)
        if values is None:
            continue
        if values.non_integral:
            raise DataError(f"labelCol {label!r} has {values.non_integral} non-integral value(s), but loss "
                            f"{loss!r} needs class indices 0..C-1; index the labels "
                            "(StringIndexer) or use a regression loss")
        if values.minimum is not None and values.minimum < 0:
            raise DataError(f"labelCol {label!r} has negative value {values.minimum:g}; class indices "
                            "start at 0")
