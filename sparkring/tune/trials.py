"""The trials of a Tuner's study: each trial's param map, asked of Optuna when a worker starts it;
the judge that answers its epoch reports with the pruner's verdict; its MLflow run; what it ended
as (COMPLETE with its last epoch's metric, PRUNED, FAIL with its error); the best model so far."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .gate import GO_ON, PRUNE, EpochGate, give_verdict, read_report

log = logging.getLogger(__name__)

PRUNERS = ("asha", "hyperband", "median", "none")


@dataclass(frozen=True)
class TrialRecord:
    """One trial of the study: its number, Params (as the space named them), state (COMPLETE,
    PRUNED, FAIL, RUNNING), metric (the last epoch's, or the last reported for a pruned trial),
    the epochs it ran and, for a failed trial, its error.

    >>> TrialRecord(3, {"lr": 0.01}, "PRUNED", 1.7, epochs=2).state
    'PRUNED'
    """

    number: int
    params: Dict[str, Any]
    state: str
    metric: Optional[float]
    epochs: int
    error: Optional[str] = None


def pruner_for(pruner: Any) -> Any:
    """The Optuna pruner a Tuner's ``pruner`` names (a pruner object is used as it is).

    >>> type(pruner_for("asha")).__name__
    'SuccessiveHalvingPruner'
    """
    if not isinstance(pruner, str):
        return pruner
    if pruner not in PRUNERS:
        from ..errors import ConfigurationError

        raise ConfigurationError(f"pruner={pruner!r}: use one of {list(PRUNERS)} or an optuna pruner object")
    import optuna

    return {"asha": optuna.pruners.SuccessiveHalvingPruner, "hyperband": optuna.pruners.HyperbandPruner,
            "median": optuna.pruners.MedianPruner, "none": optuna.pruners.NopPruner}[pruner]()


def counted(trial: Any) -> bool:
    """Whether a finished trial counts toward ``trials``: one that ran to its end, was pruned, or
    failed on its own (not one an interrupted tuner left behind)."""
    state = trial.state.name
    return state in ("COMPLETE", "PRUNED") or (state == "FAIL" and "error" in trial.user_attrs)


def trial_params(space: Any, trial: Any) -> Dict[str, Any]:
    """The Params a trial fits with: the space's callable's answer, or a suggestion per distribution."""
    if callable(space):
        params = space(trial)
        if not isinstance(params, dict):
            raise TypeError(f"the space callable returned {type(params).__name__}: return a dict of Params")
        return params
    return {name: _suggest(trial, name, distribution) for name, distribution in space.items()}


def _suggest(trial: Any, name: str, distribution: Any) -> Any:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(distribution, FloatDistribution):
        return trial.suggest_float(name, distribution.low, distribution.high, log=distribution.log,
                                   step=distribution.step)
    if isinstance(distribution, IntDistribution):
        return trial.suggest_int(name, distribution.low, distribution.high, step=distribution.step,
                                 log=distribution.log)
    if isinstance(distribution, CategoricalDistribution):
        return trial.suggest_categorical(name, distribution.choices)
    raise TypeError(f"space[{name!r}]: {type(distribution).__name__} is not a Float, Int or Categorical distribution")


class Judge:
    """While a trial fits: answers each epoch's report (under ``root`` of ``fs``) with the pruner's
    verdict, reporting the value to the Optuna ``trial`` (``lock``: the study's, shared by trials)."""

    def __init__(self, trial: Any, fs: Any, root: str, lock: threading.Lock):
        self.trial, self.fs, self.root, self.lock = trial, fs, root, lock
        self.done = threading.Event()
        self.pruned_at: Optional[int] = None
        self.thread = threading.Thread(target=self._answer, name=f"sparkring-judge-{trial.number}", daemon=True)
        self.thread.start()

    def _answer(self) -> None:
        epoch = 0
        while not self.done.is_set():
            value = read_report(self.fs, self.root, epoch)
            if value is None:
                self.done.wait(0.01)
                continue
            with self.lock:
                self.trial.report(value, epoch)
                prune = self.trial.should_prune()
            give_verdict(self.fs, self.root, epoch, PRUNE if prune else GO_ON)
            if prune:
                self.pruned_at = epoch
                return
            epoch += 1

    def stop(self) -> None:
        """Stop the judging thread and wait for it."""
        self.done.set()
        self.thread.join()


class _ParamMaps(Sequence):
    """What fitMultiple reads: the i-th param map is asked of Optuna when a worker starts fit i."""

    def __init__(self, runs: "TrialRuns", count: int):
        self.runs, self.size = runs, count

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: Any) -> Any:
        if not isinstance(index, int) or not 0 <= index < self.size:
            raise IndexError(index)
        return self.runs.start(index)


class TrialRuns:
    """The trials this tuner runs on ``study``: started by fitMultiple's workers (one thread a
    trial), ended by the tuner with the fitted model or the error."""

    def __init__(self, study: Any, estimator: Any, store: Any, space: Any, metric: str, study_name: str, spark: Any):
        self.study, self.estimator, self.store, self.space, self.metric = study, estimator, store, space, metric
        self.study_name, self.spark = study_name, spark
        self.lock = threading.Lock()
        self.running: Dict[int, Tuple[Any, Judge]] = {}
        self.mine = threading.local()  # the trial this worker thread runs
        self.best: Optional[Tuple[int, Any, float]] = None
        self.parent: Optional[str] = None

    def param_maps(self, count: int) -> Sequence:
        """The ParamMaps of ``count`` trials, each drawn as fitMultiple asks for it."""
        return _ParamMaps(self, count)

    def begin(self, trial: Any) -> None:
        """Optuna's ``trial`` begins on this thread (its objective's), which fits it next."""
        self.mine.trial = trial
        self.mine.index = None  # its fit's index in fitMultiple, once start() has it

    def start(self, index: int) -> Dict[Any, Any]:
        """Fit ``index`` of fitMultiple begins on this thread: its param map, from this thread's trial."""
        import fsspec

        est = self.estimator
        trial = self.mine.trial
        params = trial_params(self.space, trial)
        store = self.store
        run_id = f"{self.study_name}-trial-{trial.number:04d}"
        url = store.checkpoint_url(run_id, "tune-gate")
        fs, root = fsspec.core.url_to_fs(url, **store.storage_options)
        judge = Judge(trial, fs, root, self.lock)
        self.running[index] = (trial, judge)
        self.mine.index = index
        self._begin_mlflow(trial, params)
        with contextlib.suppress(Exception):  # Spark Connect: no SparkContext, no pools
            self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", f"sparkring-trial-{trial.number}")
        gate = EpochGate(url, self.metric, dict(store.storage_options))
        callbacks = list(est.config().callbacks or []) + [gate]
        fixed = {"store": store, "runId": run_id, "callbacks": callbacks, "verbose": 0}
        return {est.getParam(name): value for name, value in {**params, **fixed}.items()}

    def finished(self, index: int, model: Any) -> float:
        """Fit ``index`` ended: its last epoch's metric (COMPLETE), or optuna.TrialPruned."""
        import optuna

        trial, judge = self.running.pop(index)
        judge.stop()
        value = model.history[-1].get(self.metric) if model.history else None
        if judge.pruned_at is not None:
            self._end(trial, "PRUNED", f"pruned at epoch {judge.pruned_at}")
            raise optuna.TrialPruned(f"trial {trial.number} pruned at epoch {judge.pruned_at}")
        if value is None or not math.isfinite(value):
            error = f"the last epoch's {self.metric} is {value}"
            trial.set_user_attr("error", error)
            self._end(trial, "FAIL", error)
            raise ValueError(error)
        with self.lock:
            self._keep_if_best(float(value), trial.number, model)
        self._end(trial, "COMPLETE", f"{self.metric}={value:g}")
        return float(value)

    def failed(self, exc: BaseException) -> None:
        """This thread's trial raised: FAIL with its error (Optuna records it); the study goes on."""
        trial = self.mine.trial
        self._stop_judge()
        trial.set_user_attr("error", _clipped(f"{type(exc).__name__}: {exc}"))
        self._end(trial, "FAIL", str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)

    def interrupted(self) -> None:
        """This thread's trial was interrupted with the tuner: FAIL, not counted (a later run redoes it)."""
        trial = self.mine.trial
        self._stop_judge()
        trial.set_user_attr("interrupted", True)
        self._end(trial, "FAIL", "interrupted")

    def _end(self, trial: Any, state: str, why: str) -> None:
        log.info("trial %d: %s (%s)", trial.number, state, why)
        self.mine.trial = self.mine.index = None
        self._end_mlflow(state)

    def forget_interrupted(self) -> None:
        """Trials an earlier tuner left RUNNING (its process ended mid-trial) become FAIL, uncounted."""
        for trial in self.study.get_trials(deepcopy=False, states=(_state("RUNNING"),)):
            self.study.tell(trial.number, state=_state("FAIL"))
            log.info("trial %d of an earlier run was left running: marked FAIL and not counted", trial.number)

    def _stop_judge(self) -> None:
        """This thread's fit ended without finished(): its judge stops answering."""
        entry = self.running.pop(self.mine.index, None) if self.mine.index is not None else None
        if entry is not None:
            entry[1].stop()

    def _keep_if_best(self, value: float, number: int, model: Any) -> None:
        """The study's best model so far, kept in memory (``save_best`` writes it once, at the end)."""
        values = [t.value for t in self.study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
        values += [self.best[2]] if self.best is not None else []
        minimize = self.study.direction.name == "MINIMIZE"
        if values and (value >= min(values) if minimize else value <= max(values)):
            return
        self.best = (number, model, value)

    def save_best(self) -> None:
        """This run's best model, where it is the study's best, saved for a tuner that resumes the
        study in another process (once a run: saving is a Spark job)."""
        folder = self._best_model_folder()
        complete = [t for t in self.study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
        if folder is None or self.best is None or not complete or self.study.best_trial.number != self.best[0]:
            return
        self.best[1].write().overwrite().save(folder)

    def _best_model_folder(self) -> Optional[str]:
        return self.store.local_path(self.store.run_path(self.study_name, "best-model"))

    def best_model(self, number: int) -> Any:
        """The fitted model of trial ``number`` (the study's best): this run's, or the one saved by
        the run that fitted it."""
        if self.best is not None and self.best[0] == number:
            return self.best[1]
        folder = self._best_model_folder()
        if folder is None or not os.path.isdir(folder):
            return None
        from ..estimator.model import SparkRingModel

        return SparkRingModel.load(folder)

    @contextlib.contextmanager
    def parent_run(self, mode: str) -> Iterator[None]:
        """The MLflow run the trials' runs nest under: the active run, or (mode 'on') a new one."""
        if mode == "off":
            yield
            return
        import mlflow

        active = mlflow.active_run()
        if active is None and mode != "on":
            yield
            return
        started = mlflow.start_run(run_name=self.study_name) if active is None else None
        parent = active if active is not None else started
        assert parent is not None
        self.parent = parent.info.run_id
        try:
            yield
        finally:
            if started is not None:
                mlflow.end_run()

    def _begin_mlflow(self, trial: Any, params: Dict[str, Any]) -> None:
        if self.parent is None:
            return
        import mlflow

        mlflow.start_run(run_name=f"trial {trial.number}", parent_run_id=self.parent,
                         tags={"sparkring.tune.study": self.study_name, "sparkring.tune.trial": str(trial.number)})
        mlflow.log_params({f"trial.{k}": str(v)[:500] for k, v in trial.params.items()})

    def _end_mlflow(self, state: str) -> None:
        if self.parent is None:
            return
        import mlflow

        mlflow.set_tag("sparkring.tune.state", state)
        mlflow.end_run(status="FAILED" if state == "FAIL" else "FINISHED")

    def records(self) -> List[TrialRecord]:
        """One row a trial of the study (earlier runs' included)."""
        rows = []
        for t in self.study.get_trials(deepcopy=False):
            metric = t.value if t.state.name == "COMPLETE" else (
                t.intermediate_values[t.last_step] if t.last_step is not None else None)
            rows.append(TrialRecord(t.number, dict(t.params), t.state.name, metric, len(t.intermediate_values),
                                    t.user_attrs.get("error")))
        return rows


def _state(name: str) -> Any:
    from optuna.trial import TrialState

    return TrialState[name]


def _clipped(error: str, limit: int = 2000) -> str:
    """An error short enough for the study's storage, keeping its head and its tail (a traceback's cause is last)."""
    if len(error) <= limit:
        return error
    head = limit // 4
    return error[:head] + "\n...\n" + error[-(limit - head - 5):]

