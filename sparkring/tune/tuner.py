"""Hyperparameter search over a SparkRingEstimator: Optuna asks for trials, each a fit() of the
estimator copied with the trial's Params on its own ranks, several at once, each pruned at an
epoch's end when Optuna's pruner says so; the study lives in an Optuna storage, so a tuner started
again with the same study name goes on where it stopped.

The trials run through the estimator's fitMultiple (as CrossValidator's parallel fits do): the
DataFrame is prepared once for every trial, and each trial's param map is asked of Optuna only
when a free worker starts it."""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from ..data import Store
from ..errors import ConfigurationError
from ..estimator.checks import fit_store
from .trials import TrialRecord, TrialRuns, counted, pruner_for

log = logging.getLogger(__name__)

Space = Union[Mapping[str, Any], Callable[[Any], Dict[str, Any]]]


@dataclass
class TuneResult:
    """What a search found: the best trial's Params (``best_params``, as the space named them) and
    fitted model (``best_model``), the Optuna ``study``, and one row a trial (``trials``).

    >>> result = Tuner(est, space, trials=8).fit(df)  # doctest: +SKIP
    >>> result.best_model.transform(df)  # doctest: +SKIP
    """

    best_params: Dict[str, Any]
    best_model: Any
    study: Any
    trials: List[TrialRecord]


class Tuner:
    """Search ``space`` for the Params of ``estimator`` that give the best ``metric`` (a figure of
    each epoch's history: ``val_loss``, ``val_accuracy``, ``loss``, ...; ``mode`` "min" or "max").

    ``space`` maps Param names to Optuna distributions, or is a callable ``(optuna.Trial) -> dict``
    of Params (it may build the model: ``{"model": lambda: Net(width=trial.suggest_int("w", 8, 64))}``).
    ``trials`` finished trials make the study (those of an earlier run of the same ``studyName``
    count); up to ``concurrentTrials`` run at once (default: as many as the session's task slots
    hold fits of ``numProc`` ranks). ``pruner``: "asha" (Optuna's SuccessiveHalvingPruner),
    "hyperband", "median", "none", or an Optuna pruner. ``storage``: an Optuna storage URL; by
    default a SQLite file in the Store's run directory of the study.

    >>> from optuna.distributions import FloatDistribution
    >>> tuner = Tuner(est, {"gradientClipNorm": FloatDistribution(0.1, 10.0, log=True)},
    ...               metric="val_loss", trials=12, concurrentTrials=2)  # doctest: +SKIP
    >>> result = tuner.fit(df)  # doctest: +SKIP
    """

    def __init__(self, estimator: Any, space: Space, metric: str = "val_loss", mode: str = "min", trials: int = 20,
                 concurrentTrials: Optional[int] = None, pruner: Any = "asha", sampler: Any = None,
                 storage: Optional[str] = None, studyName: Optional[str] = None):
        if mode not in ("min", "max"):
            raise ConfigurationError(f"mode={mode!r}: use 'min' or 'max'")
        if int(trials) < 1 or (concurrentTrials is not None and int(concurrentTrials) < 1):
            raise ConfigurationError(f"trials={trials}, concurrentTrials={concurrentTrials}: give positive counts")
        _check_space(estimator, space)
        if metric.startswith("val_") and not estimator.config().validation:
            raise ConfigurationError(f"metric={metric!r} is a validation figure, but the estimator has no "
                                     "validation split: set validation= (e.g. 0.2) or use metric='loss'")
        pruner_for(pruner)  # an unknown name is refused now
        self.estimator, self.space, self.metric, self.mode = estimator, space, metric, mode
        self.trials, self.concurrent_trials = int(trials), concurrentTrials
        self.pruner, self.sampler, self.storage = pruner, sampler, storage
        self.study_name = studyName or f"tune-{uuid.uuid4().hex[:8]}"

    def fit(self, df: Any) -> TuneResult:
        """Run the trials the study still lacks on ``df``; the result of the whole study."""
        optuna = _optuna()
        store = fit_store(self.estimator.config())  # every trial's, and the study's SQLite file
        study = optuna.create_study(storage=self._storage_url(store), study_name=self.study_name,
                                    direction="minimize" if self.mode == "min" else "maximize",
                                    sampler=self.sampler, pruner=pruner_for(self.pruner), load_if_exists=True)
        runs = TrialRuns(study, self.estimator, store, self.space, self.metric, self.study_name, df.sparkSession)
        runs.forget_interrupted()
        remaining = self.trials - sum(1 for t in study.get_trials(deepcopy=False) if counted(t))
        if remaining > 0:
            self._run(df, runs, remaining)
        complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
        if not complete:
            return TuneResult({}, None, study, runs.records())
        best = study.best_trial
        return TuneResult(dict(best.params), runs.best_model(best.number), study, runs.records())

    def _run(self, df: Any, runs: TrialRuns, remaining: int) -> None:
        """Optuna's own loop (``optimize`` on ``workers`` threads) runs the trials; each trial's
        objective takes the next fit of the estimator's fitMultiple, whose param map it answers."""
        workers = min(remaining, self.concurrent_trials or _free_fits(df.sparkSession, self.estimator))
        log.info("study %s: %d trial(s) to run, %d at once", self.study_name, remaining, workers)
        fits = self.estimator.fitMultiple(df, runs.param_maps(remaining))

        def objective(trial: Any) -> float:
            runs.begin(trial)
            try:
                index, model = next(fits)
            except Exception as exc:
                runs.failed(exc)
                raise  # Optuna records the trial as FAIL and goes on (catch=)
            except BaseException:
                runs.interrupted()  # Ctrl-C: FAIL, uncounted; Optuna starts no new trial and re-raises
                raise
            return runs.finished(index, model)

        with runs.parent_run(self.estimator.config().mlflow_logging):
            try:
                runs.study.optimize(objective, n_trials=remaining, n_jobs=workers, catch=(Exception,),
                                    gc_after_trial=False)
            finally:
                runs.save_best()

    def _storage_url(self, store: Store) -> Optional[str]:
        if self.storage is not None:
            return self.storage
        folder = store.local_path(store.run_path(self.study_name))
        if folder is None:
            log.warning("study %s lives in memory (no local Store for its SQLite file): give storage= to "
                        "resume it later", self.study_name)
            return None
        import os

        os.makedirs(folder, exist_ok=True)
        return f"sqlite:///{os.path.join(folder, 'study.db')}"


def _check_space(estimator: Any, space: Space) -> None:
    if callable(space):
        return
    if not isinstance(space, Mapping) or not space:
        raise ConfigurationError("space: give a dict of Param name -> Optuna distribution, or a callable "
                                 "(optuna.Trial) -> dict of Params")
    unknown = [name for name in space if not estimator.hasParam(name)]
    if unknown:
        raise ConfigurationError(f"space names {unknown}, which are no Params of {type(estimator).__name__}; "
                                 "use Param names (e.g. batchSize), or a callable space for anything else "
                                 "(an optimizer's learning rate, the model's width)")
    for name, distribution in space.items():
        if not hasattr(distribution, "_contains"):
            raise ConfigurationError(f"space[{name!r}] = {distribution!r} is no Optuna distribution: use e.g. "
                                     "optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)")


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigurationError("the Tuner runs Optuna studies: pip install 'sparkring[tune]'") from None
    return optuna


def _free_fits(spark: Any, estimator: Any) -> int:
    """How many fits of numProc ranks the session's task slots hold at once (1 where unknown)."""
    try:
        slots = spark.sparkContext.defaultParallelism
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext: one trial at a time unless told
        return 1
    return max(1, slots // (estimator.config().num_proc or 1))


