"""MLflow tracking of a fit, from the driver only (executors need no MLflow): the estimator's
Params, every epoch's metrics as rank 0 reports them, the loss curve and the trained torch model.

Runs are addressed by id through MlflowClient, never through MLflow's active-run stack, which
is per thread: CrossValidator fits its grid points on pool threads, where the user's run is not
active; the child runs of a grid are created with the parent's id (FitTracker.start).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, get_args

import numpy as np
import torch

from ..runner import ConfigurationError
from ..runner.versions import pinned
from ..trainer.events import EpochDone, TrainingEvent

log = logging.getLogger(__name__)

MlflowLogging = Literal["auto", "on", "off"]
MODES: Tuple[MlflowLogging, ...] = get_args(MlflowLogging)
MODEL_NAME = "model"
LOSS_CURVE = "loss_curve.png"
STEP_TIME = "step_time.png"  # where each epoch's training seconds went, stacked by part
_PARENT_TAG = "mlflow.parentRunId"
_GRID_TAG = "sparkring.grid_index"
_FITS_TAG = "sparkring.fits"
_PARAM_VALUE_CHARS = 500
_EXAMPLE_ROWS = 5


def check_mode(mode: str) -> None:
    """Before any Spark job: a known mode, and MLflow importable where it is asked for."""
    if mode not in MODES:
        raise ConfigurationError(f"mlflowLogging={mode!r}: use 'auto' (log into the active MLflow run, if any), "
                                 "'on' or 'off'")
    if mode == "on":
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise ConfigurationError("mlflowLogging='on' but mlflow is not installed on the driver: "
                                     "pip install 'sparkring[mlflow]' (or set mlflowLogging='off')") from None


def active_run_id() -> Optional[str]:
    """The calling thread's active MLflow run, without importing MLflow where nobody did."""
    mlflow = sys.modules.get("mlflow")
    run = mlflow.active_run() if mlflow is not None else None
    return run.info.run_id if run is not None else None


def param_value(value: Any) -> str:
    """A Param as MLflow shows it: plain values as they are, objects by class name and repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        text = str(value)
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        text = str(list(value))
    elif callable(value) and hasattr(value, "__qualname__") and not isinstance(value, torch.nn.Module):
        text = f"{type(value).__name__}: {getattr(value, '__module__', '')}.{value.__qualname__}"
    else:
        text = f"{type(value).__name__}: {value!r}"
    return text if len(text) <= _PARAM_VALUE_CHARS else text[:_PARAM_VALUE_CHARS - 3] + "..."


def epoch_metrics(logs: Dict[str, Any]) -> Dict[str, float]:
    """An epoch's numeric figures (train and validation, per head), without the epoch number."""
    return {k: float(v) for k, v in logs.items()
            if k != "epoch" and isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)}


class FitTracker:
    """Logs one fit into one MLflow run; ``__call__`` takes rank 0's events as they arrive.

    >>> tracker = FitTracker.start("auto", params={"epochs": 3})  # doctest: +SKIP
    >>> tracker(0, EpochDone(epoch=0, logs={"epoch": 0, "loss": 0.4}))  # doctest: +SKIP
    >>> tracker.finish(history, net, example_args)  # doctest: +SKIP
    """

    def __init__(self, run_id: str, started: str):
        from mlflow.tracking import MlflowClient

        self.run_id = run_id
        # who ends the run: "" (the user's run), "fluent" (started here as the thread's active run),
        # "client" (a child run of a grid point, created by id)
        self.started = started
        self.prefix = ""  # a grid point's k-th fit logs its epochs as fold{k}/<metric>
        self.client = MlflowClient()
        self.logged_epochs: set = set()
        self.lock = threading.Lock()

    @classmethod
    def start(cls, mode: str, params: Dict[str, Any], parent_run_id: Optional[str] = None,
              grid_index: Optional[int] = None) -> Optional["FitTracker"]:
        """The run this fit logs into: a child of ``parent_run_id`` (a grid point of fitMultiple),
        else the active run, else (mode 'on') a new run; None where nothing is to be logged."""
        if mode == "off" or (mode == "auto" and parent_run_id is None and active_run_id() is None):
            return None
        import mlflow

        if parent_run_id is not None:
            tracker = cls._grid_child(parent_run_id, grid_index)
        elif active_run_id() is not None:
            tracker = cls(str(active_run_id()), started="")
        else:
            tracker = cls(mlflow.start_run().info.run_id, started="fluent")
        log.info("MLflow: logging this fit into run %s", tracker.run_id)
        tracker.log_params(params)
        return tracker

    @classmethod
    def _grid_child(cls, parent_run_id: str, grid_index: Optional[int]) -> "FitTracker":
        """One child run per grid point: CrossValidator fits each point once per fold, and the
        k-th fit of a point logs into the same child (epochs as fold{k}/<metric>, and each
        final figure averaged over the folds so far as <metric>, as CrossValidator averages)."""
        import mlflow

        client = mlflow.MlflowClient()
        parent = client.get_run(parent_run_id)
        found = client.search_runs([parent.info.experiment_id],
                                   filter_string=f"tags.`{_PARENT_TAG}` = '{parent_run_id}' and "
                                                 f"tags.`{_GRID_TAG}` = '{grid_index}'")
        if found:
            run = found[0]
            client.update_run(run.info.run_id, status="RUNNING")
            fits = int(run.data.tags.get(_FITS_TAG, "0"))
        else:
            run = client.create_run(parent.info.experiment_id, run_name=f"grid-{grid_index}",
                                    tags={_PARENT_TAG: parent_run_id, _GRID_TAG: str(grid_index)})
            fits = 0
        client.set_tag(run.info.run_id, _FITS_TAG, str(fits + 1))
        tracker = cls(run.info.run_id, started="client")
        tracker.prefix = f"fold{fits}/"
        return tracker

    def log_params(self, params: Dict[str, Any]) -> None:
        """Log ``params`` to the run, all but those it holds already (MLflow refuses a changed value)."""
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        values = {name: param_value(value) for name, value in params.items()}
        changed = sorted(k for k, v in values.items() if k in existing and existing[k] != v)
        if changed:
            # MLflow refuses to change a logged param: a second fit in the same run keeps the first's
            log.warning("MLflow run %s already has params %s with other values; kept those", self.run_id, changed)
        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in values.items() if k not in existing])

    def __call__(self, rank: int, event: TrainingEvent) -> None:
        """Log rank 0's epoch figures."""
        if rank != 0 or not isinstance(event, EpochDone):
            return
        try:
            self.log_epoch(event.logs)
        except Exception as exc:  # noqa: BLE001 - the tracking server's trouble must not stop training
            log.warning("MLflow: epoch %s not logged now (%s); it is logged when the fit ends",
                        event.logs.get("epoch"), exc)

    def log_epoch(self, logs: Dict[str, Any]) -> None:
        """Log one epoch's figures as metrics at the epoch's step."""
        from mlflow.entities import Metric

        epoch = int(logs["epoch"])
        with self.lock:
            if epoch in self.logged_epochs:
                return
            now = int(time.time() * 1000)
            self.client.log_batch(self.run_id, metrics=[Metric(self.prefix + k, v, now, epoch)
                                                        for k, v in epoch_metrics(logs).items()])
            self.logged_epochs.add(epoch)

    def finish(self, history: Sequence[Dict[str, Any]], net: torch.nn.Module, example: Optional[tuple]) -> None:
        """The epochs no event brought (a resumed run's earlier ones, streamLogs=False), the loss
        curve and the torch model (``example``: forward()'s (args, kwargs) for a few rows)."""
        for logs in history:
            self.log_epoch(logs)
        if self.prefix and history:
            self._log_fold_means(history[-1])
        self._log_loss_curve(history)
        self._log_step_time(history)
        if not self.prefix:  # a grid point's fits keep no model: the parent's refit of the best does
            self._log_torch_model(net, example)
        self._end("FINISHED")

    def fail(self) -> None:
        """End the run as FAILED."""
        self._end("FAILED")

    def _end(self, status: str) -> None:
        if self.started == "fluent":
            import mlflow

            mlflow.end_run(status)
        elif self.started == "client":
            self.client.set_terminated(self.run_id, status)

    def _log_fold_means(self, final: Dict[str, Any]) -> None:
        from mlflow.entities import Metric

        fits = int(self.prefix[len("fold"):-1]) + 1
        latest = self.client.get_run(self.run_id).data.metrics
        now = int(time.time() * 1000)
        means = []
        for key in epoch_metrics(final):
            values = [latest[f"fold{k}/{key}"] for k in range(fits) if f"fold{k}/{key}" in latest]
            means.append(Metric(key, float(np.mean(values)), now, fits - 1))
        self.client.log_batch(self.run_id, metrics=means)

    def _log_loss_curve(self, history: Sequence[Dict[str, Any]]) -> None:
        curves = {k: [(h["epoch"] + 1, h[k]) for h in history if k in h]
                  for k in dict.fromkeys(k for h in history for k in h if k.endswith("loss"))}
        if not curves:
            return
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        for name, points in curves.items():
            ax.plot([e for e, _ in points], [v for _, v in points], marker="o", label=name)
        ax.set_xlabel("epoch")
        ax.set_ylabel("loss")
        ax.legend()
        self.client.log_figure(self.run_id, fig, f"{self.prefix}{LOSS_CURVE}")

    def _log_step_time(self, history: Sequence[Dict[str, Any]]) -> None:
        timed = [h for h in history if "time_compute" in h]
        if not timed:
            return
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        epochs = [h["epoch"] + 1 for h in timed]
        bottom = np.zeros(len(timed))
        for part in ("data", "compute", "comm", "other"):
            seconds = np.array([h[f"time_{part}"] for h in timed])
            ax.bar(epochs, seconds, bottom=bottom, label=part)
            bottom += seconds
        ax.set_xlabel("epoch")
        ax.set_ylabel("seconds (rank 0)")
        ax.legend()
        self.client.log_figure(self.run_id, fig, f"{self.prefix}{STEP_TIME}")

    def _log_torch_model(self, net: torch.nn.Module, example: Optional[tuple]) -> None:
        """``mlflow.pytorch.log_model`` with a signature and input example, as a graph that takes
        any batch size (torch.export marks the batch dimension dynamic only when the example has
        at least 2 rows); models that take several inputs, or that torch.export cannot trace,
        are logged pickled (the pytorch flavour's pyfunc serves one input tensor only)."""
        import mlflow
        from mlflow.models import infer_signature

        net.eval()
        single = example is not None and len(example[0]) == 1 and not example[1]
        example = example or ((), {})
        kwargs: Dict[str, Any] = {"pip_requirements": pip_requirements(["torch", "cloudpickle"])}
        if single:
            x = example[0][0]
            with torch.no_grad():
                out = net(x)
            if isinstance(out, torch.Tensor):
                kwargs.update(input_example=x.numpy(), signature=infer_signature(x.numpy(), out.float().numpy()))
        formats: List[str] = ["pt2", "pickle"] if "signature" in kwargs and len(example[0][0]) >= 2 else ["pickle"]
        with _run_active(self.run_id):
            for fmt in formats:
                try:
                    mlflow.pytorch.log_model(net, name=MODEL_NAME, serialization_format=fmt, **kwargs)
                    log.info("MLflow: logged the torch model as %r (%s)", MODEL_NAME, fmt)
                    return
                except Exception as exc:  # noqa: BLE001 - torch.export refuses some models: pickle them
                    if fmt == formats[-1]:
                        raise
                    log.warning("MLflow: torch.export could not trace the model (%s); logging it pickled",
                                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


class _run_active:
    """Make ``run_id`` the calling thread's active run for fluent calls (log_model), unless it is
    (only a grid point's child run, created by id on a pool thread, is not)."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.started = False

    def __enter__(self):
        import mlflow

        if active_run_id() != self.run_id:
            mlflow.start_run(run_id=self.run_id, nested=active_run_id() is not None)
            self.started = True
        return self

    def __exit__(self, *exc) -> None:
        if self.started:
            import mlflow

            # only a child run is made active here; its tracker sets its final status next
            mlflow.end_run()


def pip_requirements(packages: Sequence[str]) -> List[str]:
    """Pinned requirements of the logged model (given, so MLflow does not load the model in a
    subprocess to infer them)."""
    return [pinned(name) for name in packages]


def example_args(model, dataset) -> Optional[tuple]:
    """forward()'s (args, kwargs) for the first few rows of ``dataset``, prepared exactly as
    transform() prepares them; None when the DataFrame is empty."""
    from .inference import pandas_to_arrow

    predictor = model._predictor(dataset)
    sample = dataset.select(*[c.spark_column() for c in predictor.spec.columns]).limit(_EXAMPLE_ROWS).toPandas()
    if sample.empty:
        return None
    return predictor.model_args([pandas_to_arrow(sample[c]) for c in sample.columns])
