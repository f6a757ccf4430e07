"""SparkRingEstimator: fit a torch model on a DataFrame with data-parallel ranks."""
from __future__ import annotations

import dataclasses
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import cloudpickle
import torch
from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from ..collective import timeline
from ..data import DataError, FeatureSpec, Store, check_reader, petastorm_codecs, prepare
from ..data.store import check_run_id
from ..errors import RankFailedError, TrainingError
from ..runner import (
    ESTIMATOR_NAMES,
    ConfigurationError,
    ElasticLaunch,
    LaunchPlan,
    Relaunches,
    check_picklable,
    check_timeouts,
    launch,
    plan,
    relaunch_until_done,
    to_bytes,
)
from ..trainer import (
    EarlyStopping,
    RankResult,
    Sharding,
    TrainConfig,
    is_factory,
    losses,
    non_finite_reason,
    train_rank,
)
from ..trainer.checkpoints import resume_point
from ..trainer.elastic import ElasticPlan, stop_request
from ..trainer.events import TrainingEvent, from_payload
from ..trainer.lightning import check_module as check_lightning_module
from ..trainer.lightning import is_lightning_module
from . import tracking
from .console import Progress, SparkBarPause
from .model import SparkRingModel
from .params import OBJECT_PARAMS, PARAMS, SparkRingParams, check_values, signature, unknown_params
from .persistence import SparkRingReader, SparkRingWriter
from .tracking import FitTracker


def _compile_options(value: Any) -> Optional[Dict[str, Any]]:
    """The compile Param as torch.compile's keyword arguments (None: eager)."""
    if value is True:
        return {}
    return dict(value) if isinstance(value, dict) else None


@dataclass(frozen=True)
class _Checked:
    """What the checks before any Spark job decided, for fit() to go on with."""

    metrics: Dict[str, Any]
    early_stopping: Optional[EarlyStopping]
    plan: LaunchPlan
    store: Store
    spec: FeatureSpec


class SparkRingEstimator(Estimator, SparkRingParams, MLReadable, MLWritable):
    """Trains a torch.nn.Module on a Spark DataFrame with synchronous data parallelism.

    >>> est = SparkRingEstimator(
    ...     model=torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)),
    ...     optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
    ...     loss="cross_entropy", featuresCol="features", labelCol="label",
    ...     batchSize=64, epochs=5, numProc=2, validation=0.1)
    >>> model = est.fit(train_df)  # doctest: +SKIP
    >>> model.transform(test_df).select("prediction").show()  # doctest: +SKIP
    """

    _input_kwargs: Dict[str, Any]  # set by pyspark's keyword_only

    @keyword_only
    def __init__(self, **params: Any) -> None:
        # the keyword-only signature (names, types, defaults) comes from params.PARAMS: see below
        unknown_params(params)
        super().__init__()
        self._hold_data = False
        self._prepared: Optional[Any] = None
        self._grid_point: Optional[Tuple[str, int]] = None  # (parent MLflow run, index) under fitMultiple
        self._set(**{k: v for k, v in self._input_kwargs.items()})

    @keyword_only
    def setParams(self, **kwargs):
        """Set several Params at once; returns self.

        >>> est.setParams(epochs=3, batchSize=128)  # doctest: +SKIP
        """
        unknown_params(self._input_kwargs)
        return self._set(**self._input_kwargs)

    def copy(self, extra=None):
        that = super().copy(extra)
        that._hold_data = False
        that._prepared = None
        that._grid_point = None
        return that

    # -- validation before any Spark job ----------------------------------------------
    def _validate(self, df) -> "_Checked":
        """Every check that needs no Spark job, with the facts fit() goes on with."""
        lightning, metrics = self._check_training()
        spec = self._check_columns(df)
        validation = self.getOrDefault("validation")
        es = self._early_stopping(validation is not None, metrics, lightning)
        launch_plan = self._plan(df.sparkSession, self.getOrDefault("numProc"))
        self._check_sharding(launch_plan, lightning)
        self._check_elastic(launch_plan, lightning)
        if self.getOrDefault("runId") is not None:
            check_run_id(self.getOrDefault("runId"))
        store = self.getOrDefault("store") or Store()
        if not isinstance(store, Store):
            store = Store(str(store))
        if store.is_temporary and not launch_plan.facts.single_host:
            raise ConfigurationError("store is not set and this is a cluster: ranks on other hosts cannot read "
                                     "a temporary local directory; pass store=Store('hdfs://...' or 's3://...')")
        store.check_writable()
        return _Checked(metrics=metrics, early_stopping=es, plan=launch_plan, store=store, spec=spec)

    def _model_shape(self) -> torch.nn.Module:
        """The model Param as a module: itself, or what its factory builds under the meta device
        (no memory, no RNG), which every check before the Spark job looks at."""
        model = self.getOrDefault("model")
        if isinstance(model, torch.nn.Module):
            return model
        if not callable(model):
            raise ConfigurationError(f"model must be a torch.nn.Module or a zero-argument factory returning one, got "
                                     f"{type(model).__name__}: pass model=<your nn.Module> or model=lambda: MyNet()")
        try:
            with torch.device("meta"):
                built = model()
        except Exception as exc:  # noqa: BLE001 - the user's factory: say how to fix it
            raise ConfigurationError(
                f"the model factory fails under torch.device('meta') ({type(exc).__name__}: {exc}); build only the "
                "modules in it and initialize their values in initFn=lambda module: ..., which runs at full size "
                "after sharding") from exc
        if not isinstance(built, torch.nn.Module):
            raise ConfigurationError(f"the model factory returned {type(built).__name__}, not a torch.nn.Module")
        return built

    def _plan(self, spark, num_proc: Optional[int]) -> LaunchPlan:
        return plan(spark, num_proc=num_proc, use_gpu=self.getOrDefault("useGpu"), backend=self.getOrDefault("backend"),
                    stream=self.getOrDefault("streamLogs"), names=ESTIMATOR_NAMES,
                    shared_memory=self.getOrDefault("sharedMemory"), registration_wait=self.getOrDefault("startTimeout"))

    def _elastic(self, num_proc: int) -> Optional[ElasticPlan]:
        """The elastic plan where minProc or checkpointEvery asks for one (None: a plain fit)."""
        min_proc, every = self.getOrDefault("minProc"), self.getOrDefault("checkpointEvery")
        if min_proc is None and every is None:
            return None
        return ElasticPlan(global_batch=self.getOrDefault("batchSize") * num_proc, target_size=num_proc,
                           min_size=num_proc if min_proc is None else min_proc, checkpoint_every=every)

    def _check_elastic(self, launch_plan: LaunchPlan, lightning: bool) -> None:
        """What an elastic fit cannot run, refused before any Spark job."""
        min_proc = self.getOrDefault("minProc")
        if min_proc is not None and min_proc > launch_plan.num_proc:
            raise ConfigurationError(f"minProc={min_proc} is more than numProc={launch_plan.num_proc}: the fit starts "
                                     "with numProc ranks and may go on with as few as minProc; lower minProc")
        if self._elastic(launch_plan.num_proc) is None:
            return
        what = "minProc" if min_proc is not None else "checkpointEvery"
        if lightning:
            raise ConfigurationError(f"{what} (an elastic fit) does not train a LightningModule yet; drop {what}")
        if self.getOrDefault("backwardPassesPerStep") != 1:
            raise ConfigurationError(f"{what} (an elastic fit) steps on every global batch: drop "
                                     "backwardPassesPerStep (or raise batchSize instead)")

    def _check_sharding(self, launch_plan: LaunchPlan, lightning: bool) -> None:
        """What a sharded strategy cannot run, refused before any Spark job."""
        strategy = self.getOrDefault("strategy")
        if strategy == "ddp":
            for sharded_only in ("cpuOffload", "asyncCheckpoint"):
                if self.getOrDefault(sharded_only):
                    raise ConfigurationError(f"{sharded_only}=True applies to a sharded model: set strategy='fsdp' "
                                             f"(or 'hsdp'), or drop {sharded_only}")
            return
        if launch_plan.backend == "mpi":
            raise ConfigurationError(f"strategy={strategy!r} needs torch.distributed collectives (DTensor, FSDP2): "
                                     "use backend='gloo' or 'nccl', or strategy='ddp' with backend='mpi'")
        if strategy == "hsdp" and launch_plan.facts.single_host:
            raise ConfigurationError("strategy='hsdp' shards within a host and replicates across hosts, but every "
                                     "rank runs on one host: there it is strategy='fsdp'")
        if lightning:
            raise ConfigurationError(f"strategy={strategy!r} does not train a LightningModule yet: use strategy='ddp'")
        if isinstance(self.getOrDefault("optimizer"), torch.optim.Optimizer):
            raise ConfigurationError(f"strategy={strategy!r} builds the optimizer over each rank's shards: pass "
                                     "optimizer= as a factory, e.g. optimizer=lambda params: torch.optim.Adam(params)")
        sparse = [name for name, m in self._model_shape().named_modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
        if sparse:
            raise ConfigurationError(f"strategy={strategy!r} shards parameters, which sparse gradients cannot be: "
                                     f"module(s) {sparse} use sparse=True; drop it or use strategy='ddp'")
        if self.getOrDefault("precision") == "16-mixed":
            raise ConfigurationError(f"precision='16-mixed' scales the loss for replicated gradients; with "
                                     f"strategy={strategy!r} use precision='bf16-mixed' (FSDP2 computes in bfloat16 "
                                     "and reduces in float32)")
        if self.getOrDefault("gradientCompression") != "none":
            raise ConfigurationError(f"gradientCompression applies to strategy='ddp'; with {strategy!r} FSDP2 "
                                     "reduce-scatters gradients in their own dtype")

    def _check_training(self) -> Tuple[bool, Dict[str, Any]]:
        """The model, optimizer, losses, metrics and Param values; (is a LightningModule, metrics)."""
        model = self._model_shape()
        lightning = is_lightning_module(model)
        if lightning:
            self._check_lightning_module(model)
        else:
            opt = self.getOrDefault("optimizer")
            if opt is None or not (isinstance(opt, torch.optim.Optimizer) or callable(opt)):
                raise ConfigurationError("optimizer must be a torch.optim.Optimizer over model.parameters() or a "
                                         "factory, e.g. optimizer=lambda params: torch.optim.Adam(params, lr=1e-3)")
        check_timeouts(self.getOrDefault("timeout"), None, ESTIMATOR_NAMES)
        # what ships to the ranks, checked here so that a lock or an open file in the model
        # is named before the data is written
        check_picklable({name: self.getOrDefault(name) for name in OBJECT_PARAMS
                         if self.isDefined(name) and self.getOrDefault(name) is not None})
        labels = self.labelColumns()
        loss_list = self.lossList()
        if not lightning and any(loss is None for loss in loss_list):
            raise ConfigurationError("loss is not set: pass loss='cross_entropy' (or mse, nll, l1, "
                                     "bce_with_logits, smooth_l1) or a callable(output, label)")
        if len(loss_list) != len(labels):
            raise ConfigurationError(f"loss has {len(loss_list)} entries but labelCol names {len(labels)} labels "
                                     f"({labels}): give one loss per label")
        if len(set(labels)) != len(labels):
            raise ConfigurationError(f"labelCol names a column twice: {labels}")
        weights = self.getOrDefault("lossWeights")
        if weights is not None and len(weights) != len(labels):
            raise ConfigurationError(f"lossWeights has {len(weights)} entries but labelCol names {len(labels)} "
                                     "labels: give one weight per label")
        if len(self.predictionColumns()) != len(labels):
            raise ConfigurationError(f"predictionCol names {len(self.predictionColumns())} columns but labelCol "
                                     f"names {len(labels)} labels: give one prediction column per label")
        try:
            for loss in loss_list if not lightning else []:
                losses.check_loss(loss)
            metrics = losses.metric_fns(self.getOrDefault("metrics"))
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
        check_values({spec.name: self.getOrDefault(spec.name) for spec in PARAMS})
        for name in ("transformFn", "transformFnInference"):
            fn = self.getOrDefault(name)
            if fn is not None and not callable(fn):
                raise ConfigurationError(f"{name} must be a callable(batch: dict) -> dict, got {type(fn).__name__}")
        check_reader(self.getOrDefault("reader"))
        tracking.check_mode(self.getOrDefault("mlflowLogging"))
        return lightning, metrics

    def _check_columns(self, df) -> FeatureSpec:
        """The columns the Params name exist and have usable types; the FeatureSpec they make."""
        from pyspark.ml.linalg import VectorUDT
        from pyspark.sql import types as T

        labels, loss_list = self.labelColumns(), self.lossList()
        fields = {f.name: f.dataType for f in df.schema.fields}
        transform_fn = self.getOrDefault("transformFn")
        if self.getOrDefault("modelInputs") is None and transform_fn is None:
            for c in self.featureColumns():
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
        weight = self.getOrDefault("sampleWeightCol") if self.isDefined("sampleWeightCol") else None
        if weight is not None:
            if weight not in fields or not isinstance(fields[weight], T.NumericType):
                raise ConfigurationError(f"sampleWeightCol {weight!r} must be a numeric column of the DataFrame")
            if not all(isinstance(loss, str) for loss in loss_list):
                raise ConfigurationError("sampleWeightCol needs a named loss (a callable loss returns a scalar, "
                                         "so rows cannot be weighted)")
        try:
            spec = FeatureSpec.build(df.schema, inputs=self.getOrDefault("modelInputs"),
                                     features=self.featureColumns(), labels=labels, weight=weight,
                                     shapes=self.getOrDefault("inputShapes"), transform=transform_fn is not None,
                                     codecs=petastorm_codecs(df))
        except DataError as exc:
            raise ConfigurationError(str(exc)) from None
        validation = self.getOrDefault("validation")
        if isinstance(validation, str):
            if validation not in fields or not isinstance(fields[validation], T.BooleanType):
                raise ConfigurationError(f"validation={validation!r} must name a boolean column of the DataFrame")
        elif validation is not None and not 0 < validation < 1:
            raise ConfigurationError(f"validation={validation}: give a fraction strictly between 0 and 1 "
                                     "or the name of a boolean column")
        return spec

    def _check_lightning_module(self, module: torch.nn.Module) -> None:
        """A LightningModule decides its optimizer, loss and metrics itself: the Params that would
        decide them too are refused rather than silently ignored."""
        problem = check_lightning_module(module)
        if problem is not None:
            raise ConfigurationError(problem)
        given = [name for name in ("optimizer", "loss", "metrics", "lossWeights")
                 if self.isSet(name) and self.getOrDefault(name) is not None]
        if given:
            raise ConfigurationError(f"model is a LightningModule, which decides {', '.join(given)} itself "
                                     "(configure_optimizers: optimizer and LR schedulers; training_step: the loss; "
                                     "self.log: metrics): drop " + ", ".join(f"{name}=" for name in given))

    def _early_stopping(self, has_val: bool, metrics, lightning: bool = False) -> Optional[EarlyStopping]:
        es = self.getOrDefault("earlyStopping")
        if es is None:
            return None
        if isinstance(es, int):
            es = {"patience": es}
        if not isinstance(es, dict) or "patience" not in es:
            raise ConfigurationError("earlyStopping must be a patience (int) or a dict with 'patience' "
                                     "(and optional 'monitor', 'mode', 'min_delta')")
        monitor = es.get("monitor", "val_loss" if has_val else "loss")
        known = ["loss"] + list(metrics)
        if len(self.labelColumns()) > 1:
            known += [f"{label}_{name}" for label in self.labelColumns() for name in ["loss"] + list(metrics)]
        known += [f"val_{k}" for k in known] if has_val else []
        # a LightningModule's figures are what it logs: checked when the first epoch ends
        if monitor not in known and not lightning:
            raise ConfigurationError(f"earlyStopping monitors {monitor!r}, which no epoch reports; use one of {known}")
        mode = es.get("mode", "max" if "acc" in monitor else "min")
        if mode not in ("min", "max"):
            raise ConfigurationError(f"earlyStopping mode={mode!r}: use 'min' or 'max'")
        return EarlyStopping(monitor=monitor, patience=int(es["patience"]), mode=mode,
                             min_delta=float(es.get("min_delta", 0.0)))

    def _class_labels(self) -> List[Tuple[str, Any]]:
        """(label column, loss) of each head whose loss takes class indices."""
        return [(label, loss) for label, loss in zip(self.labelColumns(), self.lossList())
                if losses.label_kind(loss) == "class"]

    def _check_labels(self, ds) -> None:
        """Class-index losses need integral, non-negative labels: checked against what prepare saw
        of them in its pass over the DataFrame (no pass of their own). A boolean label is always
        a class index; an array label's values meet the loss on the ranks."""
        for label, loss in self._class_labels():
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

    # -- fit --------------------------------------------------------------------------
    def _fit(self, dataset):
        with SparkBarPause(dataset.sparkSession):
            return self._fit_paused(dataset)

    def _fit_paused(self, dataset):
        checked = self._validate(dataset)
        # one run directory holds this fit's prepared data and its checkpoints
        run_id = self.getOrDefault("runId") or uuid.uuid4().hex[:12]
        ds = prepare(dataset, checked.store, spec=checked.spec, validation=self.getOrDefault("validation"),
                     seed=self.getOrDefault("seed"), run_id=run_id, integral=[label for label, _ in self._class_labels()],
                     in_place=self.getOrDefault("readInPlace") and self.getOrDefault("reader") == "arrow")
        self._prepared = ds
        try:
            self._check_labels(ds)
            return self._fit_tracked(dataset, ds, checked, run_id)
        finally:
            if not (self.getOrDefault("keepData") or self._hold_data):
                ds.delete()

    def _fit_tracked(self, dataset, ds, checked, run_id: str) -> SparkRingModel:
        parent, index = self._grid_point or (None, None)
        tracker = FitTracker.start(self.getOrDefault("mlflowLogging"), parent_run_id=parent, grid_index=index,
                                   params={p.name: v for p, v in self.extractParamMap().items()})
        if tracker is None:
            return self._fit_prepared(dataset.sparkSession, ds, checked, run_id, None)
        try:
            model = self._fit_prepared(dataset.sparkSession, ds, checked, run_id, tracker)
            tracker.finish(model.history, model.getModel(), tracking.example_args(model, dataset))
            return model
        except BaseException:
            tracker.fail()
            raise

    def _steps_per_epoch(self, ds, num_proc: int) -> Tuple[int, int]:
        """Training and validation steps of each rank's epoch, decided here for every rank: the
        Params where set, else what the data gives each of ``num_proc`` ranks (training steps in
        whole multiples of backwardPassesPerStep; validation: the longest rank's share)."""
        bs = self.getOrDefault("batchSize")
        val_bs = self.getOrDefault("valBatchSize") or bs
        passes = self.getOrDefault("backwardPassesPerStep")
        if ds.num_batches(bs, num_proc) == 0:
            raise ConfigurationError(f"{ds.num_rows('train')} training rows give no full batch of batchSize={bs} "
                                     f"on each of numProc={num_proc} ranks: lower batchSize or numProc")
        train = self.getOrDefault("trainStepsPerEpoch") or ds.num_batches(bs, num_proc)
        train -= train % passes
        if train == 0:
            raise ConfigurationError(f"an epoch of {ds.num_batches(bs, num_proc)} step(s) per rank holds no whole "
                                     f"backwardPassesPerStep={passes}: lower backwardPassesPerStep or batchSize")
        val = 0
        if ds.num_rows("val") > 0:
            val = self.getOrDefault("validationStepsPerEpoch") or max(
                ds.num_batches(val_bs, num_proc, "val", False, r) for r in range(num_proc))
        return train, val

    def _fit_prepared(self, spark, ds, checked: _Checked, run_id: str, tracker: Optional[FitTracker]) -> SparkRingModel:
        launch_plan = checked.plan
        num_proc = launch_plan.num_proc
        bs = self.getOrDefault("batchSize")
        train_steps, val_steps = self._steps_per_epoch(ds, num_proc)
        verbose = self.getOrDefault("verbose")
        labels = self.labelColumns()
        cfg = TrainConfig(
            model=self.getOrDefault("model"), optimizer=self.getOrDefault("optimizer"),
            losses=self.lossList(), metrics=checked.metrics, dataset=ds, store=checked.store,
            run_id=run_id, spec=ds.spec, loss_weights=self.getOrDefault("lossWeights") or [1.0] * len(labels),
            batch_size=bs, val_batch_size=self.getOrDefault("valBatchSize") or bs,
            epochs=self.getOrDefault("epochs"), shuffle=self.getOrDefault("shuffle"), seed=self.getOrDefault("seed"),
            backward_passes_per_step=self.getOrDefault("backwardPassesPerStep"),
            compression=self.getOrDefault("gradientCompression"),
            lr_scaling=self.getOrDefault("learningRateScaling"), warmup_epochs=self.getOrDefault("warmupEpochs"),
            train_steps=train_steps, val_steps=val_steps,
            callbacks=list(self.getOrDefault("callbacks") or []), early_stopping=checked.early_stopping,
            use_gpu=launch_plan.use_gpu, has_validation=ds.num_rows("val") > 0,
            transform_fn=self.getOrDefault("transformFn"), reader_workers=self.getOrDefault("readerWorkers"),
            multi_head=len(labels) > 1, skip_non_finite=self.getOrDefault("onNonFinite") == "skip_step",
            reader=self.getOrDefault("reader"), lightning=is_lightning_module(self._model_shape()),
            sharding=Sharding(self.getOrDefault("strategy"), tuple(self.getOrDefault("fsdpWrap") or ()),
                              self.getOrDefault("initFn"), self.getOrDefault("asyncCheckpoint"),
                              cpu_offload=self.getOrDefault("cpuOffload"), bf16_compute=self.getOrDefault("precision") == "bf16-mixed"),
            precision=self.getOrDefault("precision"), compile=_compile_options(self.getOrDefault("compile")),
            elastic=self._elastic(num_proc), timeline=self.getOrDefault("timeline") is not None)
        progress = Progress(verbose)
        listeners: List[Callable[[int, TrainingEvent], None]] = [progress] if tracker is None else [progress, tracker]

        def on_event(rank: int, payload: Any) -> None:
            event = from_payload(payload)
            if event is not None:
                for listener in listeners:
                    listener(rank, event)

        def launch_once(now: LaunchPlan, counts: Optional[Relaunches]) -> List[Any]:
            # validation splits its rows among the ranks there are: its steps follow their number
            run_cfg = cfg if cfg.elastic is None or counts is None else dataclasses.replace(
                cfg, elastic=dataclasses.replace(cfg.elastic, **dataclasses.asdict(counts)),
                val_steps=self._steps_per_epoch(ds, now.num_proc)[1])
            return launch(spark, now, train_rank, args=(run_cfg,), timeout=self.getOrDefault("timeout"),
                          start_timeout=self.getOrDefault("startTimeout"),
                          verbose=2 if verbose >= 2 else (1 if verbose else 0), on_event=on_event)

        try:
            if cfg.elastic is None:
                results = launch_once(launch_plan, None)
            else:  # the driver launches again when ranks are lost, not Spark's stage retry (same size only)
                results = relaunch_until_done(
                    spark, dataclasses.replace(launch_plan, attempts=1), ElasticLaunch(
                        cfg.elastic.target_size, cfg.elastic.min_size, self.getOrDefault("maxRestarts"),
                        self.getOrDefault("startTimeout"), start_timeout_name="startTimeout", min_size_name="minProc"),
                    launch_once, replan=lambda n: dataclasses.replace(self._plan(spark, n), attempts=1),
                    say=progress.note, request=stop_request(checked.store, run_id),
                    paused=lambda results: results[0].paused,
                    final=lambda exc: isinstance(exc, RankFailedError) and non_finite_reason(exc.remote_traceback)
                    is not None, resume_point=lambda: resume_point(checked.store, run_id))
        except RankFailedError as exc:
            reason = non_finite_reason(exc.remote_traceback)
            if reason is None:
                raise
            raise TrainingError(exc.rank, exc.remote_traceback, reason) from None
        finally:
            progress.close()
        trained = self._fresh_module()
        result: RankResult = results[0]
        if result.timeline is not None:
            timeline.merge(result.timeline, self.getOrDefault("timeline"))
        trained.load_state_dict(result.state_dict)
        model = SparkRingModel()
        self._copyValues(model)
        model._set(model=trained, runId=run_id, store=checked.store, optimizer=None)
        model.history = result.history
        model.featureSpec = ds.spec
        model.outputShapes = result.output_shapes
        return model

    def _fresh_module(self) -> torch.nn.Module:
        """A CPU module to load the trained weights into: the factory's build, or a copy made
        through the bytes the ranks got (a model on the driver's GPU is not copied on the GPU first)."""
        model = self.getOrDefault("model")
        if is_factory(model):
            torch.manual_seed(self.getOrDefault("seed"))
            return model()
        return cloudpickle.loads(to_bytes(model))

    def fitMultiple(self, dataset, paramMaps):
        """Fit one model per param map; data is prepared once and shared by every fit
        (CrossValidator and TrainValidationSplit call this), then deleted unless keepData.

        >>> for index, model in est.fitMultiple(df, grid):  # doctest: +SKIP
        ...     print(index, model.history[-1])
        """
        lock = threading.Lock()
        state = {"next": 0, "done": 0}
        used: List[Any] = []
        keep = self.getOrDefault("keepData")
        # CrossValidator calls this on the user's thread and fits on pool threads, where the
        # user's MLflow run is not active: each grid point becomes a child run of it
        parent = tracking.active_run_id() if self.getOrDefault("mlflowLogging") != "off" else None

        def fit_one(index: int) -> SparkRingModel:
            est = self.copy(paramMaps[index])
            est._hold_data = True
            est._grid_point = (parent, index) if parent is not None else None
            try:
                return est.fit(dataset)
            finally:
                if est._prepared is not None:
                    with lock:
                        used.append(est._prepared)

        class _Iterator:
            def __iter__(self):
                return self

            def __next__(self):
                with lock:
                    index = state["next"]
                    if index >= len(paramMaps):
                        raise StopIteration
                    state["next"] += 1
                try:
                    return index, fit_one(index)
                finally:
                    with lock:
                        state["done"] += 1
                        finished = state["done"] == len(paramMaps)
                    if finished and not keep:
                        for ds in {d.data_dir: d for d in used}.values():
                            ds.delete()

        return _Iterator()

    # -- persistence ------------------------------------------------------------------
    def write(self):
        return SparkRingWriter(self)

    @classmethod
    def read(cls):
        return SparkRingReader(cls)

    def _after_load(self, metadata, store) -> None:
        self._hold_data = False
        self._prepared = None
        self._grid_point = None


SparkRingEstimator.__init__.__signature__ = signature(SparkRingEstimator)  # type: ignore[attr-defined]
