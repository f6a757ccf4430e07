"""One fit as named steps over a FitContext: check, prepare, track, launch, build the fitted model.

The estimator makes a FitContext from its Params (``EstimatorConfig``) and hands it here; what a fit
learns on the way (the prepared data, a text fit's token figures, its grid point under fitMultiple)
lives on the context, never on the estimator, so that copies, grid points and reloads share nothing.
"""
from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Type

from ..data import Dataset, prepare
from ..data.text import Encoder, mean_tokens, tokenize
from ..runner import check_executor_interpreter
from ..trainer.config import LightningTrainerSettings
from ..trainer.events import TrainingEvent, from_payload
from . import checks, text, tracking
from .config import EstimatorConfig
from .console import Progress, SparkBarPause
from .fitted import FittedWeights
from .launching import launch_fit, train_config
from .links import LinkReport
from .model import SparkRingModel
from .params import param_values
from .phases import PhaseClock
from .tracking import FitTracker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GridPoint:
    """A fit that fitMultiple runs for one param map: logged as a child of ``parent_run`` (MLflow)."""

    parent_run: str
    index: int


@dataclass
class FitContext:
    """What one fit needs and learns, passed down the fit's steps (Ray Train v2's run context).

    >>> context = FitContext(config=est.config(), spark=df.sparkSession)  # doctest: +SKIP
    >>> model = fit(context, df)  # doctest: +SKIP
    """

    config: EstimatorConfig
    spark: Any                                   # the DataFrame's SparkSession (classic or Connect)
    hold_data: bool = False                      # fitMultiple shares the prepared data: it deletes it at the end
    grid_point: Optional[GridPoint] = None
    token_figures: Optional[text.TokenFigures] = None  # a text fit: its epoch lines' token figures
    prepared: Optional[Dataset] = None           # set once the data is prepared (fitMultiple collects it)
    run_id: str = ""                             # the run's folder in the Store (set when the fit starts)
    model_type: Type[SparkRingModel] = SparkRingModel  # what a fit returns (sparkring.spark's TorchModel)
    lightning_trainer: Optional[LightningTrainerSettings] = None  # Lightning's Trainer fits the module on the ranks
    train_minibatch: Optional[Callable[..., Any]] = None  # Horovod's train_minibatch_fn: each batch's step, the user's


def fit(context: FitContext, dataset) -> SparkRingModel:
    """Fit the context's configuration on ``dataset``: a fit on a text column tokenizes it first.

    >>> fit(FitContext(config=est.config(), spark=df.sparkSession), df)  # doctest: +SKIP
    """
    with SparkBarPause(context.spark):
        text.check_lora(context.config)
        if context.config.text_col is not None:
            return _fit_text(context, dataset)
        return _fit_rows(context, dataset)


def _fit_rows(context: FitContext, dataset) -> SparkRingModel:
    """Check, prepare the rows in the Store, fit on them; the prepared copy is deleted unless kept."""
    config, clock = context.config, PhaseClock()
    decided = checks.decide(config, dataset)
    check_executor_interpreter(context.spark, config.start_timeout)  # before the data is written
    # one run directory holds this fit's prepared data and its checkpoints
    context.run_id = config.run_id or uuid.uuid4().hex[:12]
    ds = prepare(dataset, decided.store, spec=decided.spec, validation=config.validation, seed=config.seed,
                 run_id=context.run_id, integral=[label for label, _ in checks.class_labels(config)],
                 in_place=config.read_in_place and config.reader == "arrow")
    context.prepared = ds
    try:
        checks.check_labels(config, ds)
        decided.check_input_layer(ds.spec)
        return _fit_tracked(context, dataset, ds, decided=decided, clock=clock)
    finally:
        if not (config.keep_data or context.hold_data):
            _delete_quietly(ds)


def _fit_text(context: FitContext, dataset) -> SparkRingModel:
    """Tokenize textCol on the executors, fit on the token columns, add the language-model figures."""
    config = context.config
    shape = checks.model_shape(config)  # a factory's model built once, under the meta device
    layout = text.text_layout(config, dataset, shape)
    if config.pipeline_parallel > 1:  # where the stages are cut is known before tokenizing
        checks.check_pipeline(config, shape)
    if config.store is not None:  # before tokenizing: no Spark job for a Store out of reach
        checks.fit_store(config).check_writable()
    check_executor_interpreter(context.spark, config.start_timeout)  # the executors tokenize with sparkring
    tokenized, counts = tokenize(dataset, Encoder(config.tokenizer), layout)
    figures = text.TokenFigures(mean_tokens(counts), sum(p.numel() for p in shape.parameters()),
                                config.peak_flops, config.task != text.CLASSIFY)
    on_tokens = dataclasses.replace(context, config=text.token_config(config, layout), token_figures=figures)
    try:
        model = _fit_rows(on_tokens, tokenized)
    finally:
        tokenized.unpersist()
        context.prepared, context.run_id = on_tokens.prepared, on_tokens.run_id
    # transform(inference=...) reads the documents: the fitted model's own Params, but textCol
    model._set_config(dataclasses.replace(model.config(), text_col=layout.column))
    model.history = text.with_figures(model.history, counts, figures, config.model_parallel.group_size)
    return model


def _fit_tracked(context: FitContext, dataset, ds: Dataset, *, decided: checks.FitDecisions,
                 clock: PhaseClock) -> SparkRingModel:
    """The fit, logged into MLflow where mlflowLogging and the active run ask for it."""
    grid = context.grid_point
    tracker = FitTracker.start(context.config.mlflow_logging, params=param_values(context.config),
                               parent_run_id=grid.parent_run if grid else None, grid_index=grid.index if grid else None)
    if tracker is None:
        return _fit_prepared(context, ds, decided=decided, tracker=None, clock=clock)
    try:
        model = _fit_prepared(context, ds, decided=decided, tracker=tracker, clock=clock)
        tracker.finish(model.history, model.getModel(), tracking.example_args(model, dataset))
        return model
    except BaseException:
        tracker.fail()
        raise


def _fit_prepared(context: FitContext, ds: Dataset, *, decided: checks.FitDecisions,
                  tracker: Optional[FitTracker], clock: PhaseClock) -> SparkRingModel:
    """Launch the ranks on the prepared data, reporting their events; the fitted model."""
    config = context.config
    cfg = dataclasses.replace(train_config(config, decided, ds, context.run_id),
                              lightning_trainer=context.lightning_trainer, train_minibatch=context.train_minibatch)
    progress = Progress(config.verbose, context.token_figures)
    listeners: List[Callable[[int, TrainingEvent], None]] = [progress, clock, LinkReport(progress.note)]
    if tracker is not None:
        listeners.append(tracker)
    clock.launching()

    def on_event(rank: int, payload: Any) -> None:
        event = from_payload(payload)
        if event is not None:
            for listener in listeners:
                listener(rank, event)

    try:
        result = launch_fit(context.spark, config, cfg, decided=decided, on_event=on_event, say=progress.note)
    finally:
        progress.close()
    model = context.model_type()
    model._set_config(config)
    model._set(runId=context.run_id, store=decided.store, optimizer=None)
    if result.weights is None:  # only a paused fit returns none, and launch_fit raises for it
        raise RuntimeError(f"rank 0 of run {context.run_id} returned no weights")
    model.weights = FittedWeights(decided.store.url_of(result.weights), decided.store.storage_options)
    model.history = result.history
    model.featureSpec = ds.spec
    model.outputShapes = result.output_shapes
    model.phases = clock.phases()
    return model


def _delete_quietly(ds: Dataset) -> None:
    """Remove a fit's prepared copy; a Store that fails here (out of reach: often why the fit
    failed) is logged, never raised over the fit's own outcome."""
    try:
        ds.delete()
    except Exception as exc:  # noqa: BLE001 - every filesystem raises its own type
        log.warning("the prepared data in %s could not be removed (%s): remove it by hand", ds.data_dir, exc)
