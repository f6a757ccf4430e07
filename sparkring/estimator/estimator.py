"""SparkRingEstimator: fit a torch model on a DataFrame with data-parallel ranks."""
from __future__ import annotations

import logging
import threading
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import cloudpickle
import torch
from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from ..data import prepare
from ..data.text import Encoder, mean_tokens, tokenize
from ..runner import to_bytes
from ..trainer import is_factory
from ..trainer.events import TrainingEvent, from_payload
from . import checks, text, tracking
from .console import Progress, SparkBarPause
from .launching import launch_fit, train_config
from .model import SparkRingModel
from .params import SparkRingParams, signature, unknown_params
from .persistence import SparkRingReader, SparkRingWriter
from .phases import PhaseClock
from .tracking import FitTracker

log = logging.getLogger(__name__)


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
        self._token_figures: Optional[text.TokenFigures] = None  # a fit on token rows: its epoch line's figures
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
        that._token_figures = None
        return that

    # -- fit --------------------------------------------------------------------------
    def _fit(self, dataset):
        with SparkBarPause(dataset.sparkSession):
            return self._fit_paused(dataset)

    def _fit_paused(self, dataset):
        text.check_lora(self)
        if self.getOrDefault("textCol") is not None:
            return self._fit_text(dataset)
        clock = PhaseClock()
        decided = checks.decide(self, dataset)
        # one run directory holds this fit's prepared data and its checkpoints
        run_id = self.getOrDefault("runId") or uuid.uuid4().hex[:12]
        ds = prepare(dataset, decided.store, spec=decided.spec, validation=self.getOrDefault("validation"),
                     seed=self.getOrDefault("seed"), run_id=run_id,
                     integral=[label for label, _ in checks.class_labels(self)],
                     in_place=self.getOrDefault("readInPlace") and self.getOrDefault("reader") == "arrow")
        self._prepared = ds
        try:
            checks.check_labels(self, ds)
            return self._fit_tracked(dataset, ds, decided, run_id, clock)
        finally:
            if not (self.getOrDefault("keepData") or self._hold_data):
                _delete_quietly(ds)

    def _fit_text(self, dataset):
        """Tokenize textCol on the executors, fit on the token columns, add the language-model figures."""
        shape = checks.model_shape(self)  # a factory's model built once, under the meta device
        layout = text.text_layout(self, dataset, shape)
        if self.getOrDefault("store") is not None:  # before tokenizing: no Spark job for a Store out of reach
            checks.fit_store(self).check_writable()
        tokenized, counts = tokenize(dataset, Encoder(self.getOrDefault("tokenizer")), layout)
        figures = text.TokenFigures(mean_tokens(counts), sum(p.numel() for p in shape.parameters()),
                                    self.getOrDefault("peakFlops"), self.getOrDefault("task") != text.CLASSIFY)
        try:
            on_tokens = self.copy({self.getParam(name): value for name, value in text.token_params(self, layout).items()})
            on_tokens._hold_data, on_tokens._grid_point = self._hold_data, self._grid_point
            on_tokens._token_figures = figures
            model = on_tokens._fit_paused(tokenized)
        finally:
            tokenized.unpersist()
        model.set(model.getParam("textCol"), layout.column)  # transform(inference=...) reads the documents
        model.history = text.with_figures(model.history, counts, figures,
                                          self.getOrDefault("tensorParallel") * self.getOrDefault("pipelineParallel"))
        return model

    def _fit_tracked(self, dataset, ds, decided: checks.FitDecisions, run_id: str,
                     clock: PhaseClock) -> SparkRingModel:
        parent, index = self._grid_point or (None, None)
        tracker = FitTracker.start(self.getOrDefault("mlflowLogging"), parent_run_id=parent, grid_index=index,
                                   params={p.name: v for p, v in self.extractParamMap().items()})
        if tracker is None:
            return self._fit_prepared(dataset.sparkSession, ds, decided, run_id, None, clock)
        try:
            model = self._fit_prepared(dataset.sparkSession, ds, decided, run_id, tracker, clock)
            tracker.finish(model.history, model.getModel(), tracking.example_args(model, dataset))
            return model
        except BaseException:
            tracker.fail()
            raise

    def _fit_prepared(self, spark, ds, decided: checks.FitDecisions, run_id: str,
                      tracker: Optional[FitTracker], clock: PhaseClock) -> SparkRingModel:
        cfg = train_config(self, decided, ds, run_id)
        progress = Progress(self.getOrDefault("verbose"), self._token_figures)
        listeners: List[Callable[[int, TrainingEvent], None]] = [progress, clock]
        if tracker is not None:
            listeners.append(tracker)
        clock.launching()

        def on_event(rank: int, payload: Any) -> None:
            event = from_payload(payload)
            if event is not None:
                for listener in listeners:
                    listener(rank, event)

        try:
            result = launch_fit(spark, self, cfg, decided, on_event, progress.note)
        finally:
            progress.close()
        trained = self._fresh_module()
        trained.load_state_dict(result.state_dict)
        model = SparkRingModel()
        self._copyValues(model)
        model._set(model=trained, runId=run_id, store=decided.store, optimizer=None)
        model.history = result.history
        model.featureSpec = ds.spec
        model.outputShapes = result.output_shapes
        model.phases = clock.phases()
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
        self._token_figures = None


SparkRingEstimator.__init__.__signature__ = signature(SparkRingEstimator)  # type: ignore[attr-defined]


def _delete_quietly(ds) -> None:
    """Remove a fit's prepared copy; a Store that fails here (out of reach: often why the fit
    failed) is logged, never raised over the fit's own outcome."""
    try:
        ds.delete()
    except Exception as exc:  # noqa: BLE001 - every filesystem raises its own type
        log.warning("the prepared data in %s could not be removed (%s): remove it by hand", ds.data_dir, exc)
