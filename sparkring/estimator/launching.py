"""One fit's launch: its TrainConfig built from the Param table and what the driver decided, the
steps of each rank's epoch, and the launch itself (relaunched by an elastic policy where minProc or
checkpointEvery ask for one), with a non-finite loss turned into TrainingError."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, List, Optional, Tuple

import torch

from ..collective import environment
from ..collective.elastic import Relaunches
from ..errors import NonFiniteLossError, RankFailedError, TrainingError
from ..runner import (
    ESTIMATOR_NAMES,
    ConfigurationError,
    ElasticLaunch,
    ElasticPolicy,
    LaunchPlan,
    launch,
    relaunch_until_done,
)
from ..trainer import RankResult, TrainConfig, pretrained, train_rank
from ..trainer.checkpoints import resume_point
from ..trainer.elastic import stop_request
from ..trainer.saving import write_safetensors
from .checks import FitDecisions, elastic_plan, plan_launch
from .config import EstimatorConfig
from .params import PARAMS

log = logging.getLogger(__name__)


def steps_per_epoch(config: EstimatorConfig, ds, num_proc: int) -> Tuple[int, int]:
    """Training and validation steps of each rank's epoch, decided here for every rank: the
    Params where set, else what the data gives each of ``num_proc`` ranks (training steps in
    whole multiples of backwardPassesPerStep, or all of them where an epoch holds fewer; validation:
    the longest rank's share).

    >>> steps_per_epoch(est.config(), ds, num_proc=2)  # doctest: +SKIP
    (15, 4)
    """
    bs = config.batch_size
    passes = config.backward_passes_per_step
    if ds.num_batches(bs, num_proc) == 0:
        raise ConfigurationError(f"{ds.num_rows('train')} training rows give no full batch of batchSize={bs} "
                                 f"on each of numProc={num_proc} ranks: lower batchSize or numProc")
    train = config.train_steps_per_epoch or ds.num_batches(bs, num_proc)
    if train >= passes:
        train -= train % passes
    else:  # Horovod's rule: the batches there are add up, and the epoch ends with their update
        log.info("an epoch of %d step(s) per rank is shorter than backwardPassesPerStep=%d: each epoch makes one "
                 "update, from all its batches", train, passes)
    val = 0
    if ds.num_rows("val") > 0:
        val = config.validation_steps_per_epoch or max(
            ds.num_batches(config.validation_batch_size, num_proc, "val", False, r) for r in range(num_proc))
    return train, val


def train_config(config: EstimatorConfig, decided: FitDecisions, ds, run_id: str) -> TrainConfig:
    """The ranks' TrainConfig: every Param whose ParamSpec names a field, as it is, and what
    the driver decided (losses per head, steps, sharding, elastic plan, ...).

    >>> train_config(est.config(), decide(est.config(), df), ds, "r1").batch_size  # doctest: +SKIP
    32
    """
    labels = config.label_columns
    num_proc = decided.plan.num_proc
    parallel = config.model_parallel
    train_steps, val_steps = steps_per_epoch(config, ds, parallel.data_size(num_proc))
    as_is = {spec.field: getattr(config, spec.attr) for spec in PARAMS if spec.field is not None}
    as_is["model"], as_is["initial_weights"] = _model_for_ranks(config, decided.store, run_id)
    as_is["backward_passes_per_step"] = min(config.backward_passes_per_step, train_steps)
    return TrainConfig(
        **as_is, losses=config.losses, metrics=decided.metrics, dataset=ds, store=decided.store, run_id=run_id,
        spec=ds.spec, loss_weights=config.loss_weights or [1.0] * len(labels),
        val_batch_size=config.validation_batch_size, train_steps=train_steps, val_steps=val_steps,
        callbacks=list(config.callbacks or []), early_stopping=decided.early_stopping,
        use_gpu=decided.plan.use_gpu, has_validation=ds.num_rows("val") > 0, multi_head=len(labels) > 1,
        skip_non_finite=config.on_non_finite == "skip_step", lightning=decided.lightning,
        sharding=config.sharding, parallel=parallel, compile=config.compile_options,
        elastic=elastic_plan(config, num_proc))


# a model passed as an object above this size goes to the ranks through the Store, not in the task payload
OBJECTS_THROUGH_STORE_BYTES = 256 * 2 ** 20


def _model_for_ranks(config: EstimatorConfig, store, run_id: str) -> Tuple[Any, Optional[str]]:
    """The model the ranks build and the initial weights they read: a large module object is written
    to the run's folder once and travels as its skeleton (its parameters without values)."""
    model = config.model_or_factory
    if not isinstance(model, torch.nn.Module):
        return model, config.initial_weights
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if size <= OBJECTS_THROUGH_STORE_BYTES:
        return model, config.initial_weights
    initial = config.initial_weights
    if initial is None:
        directory = store.run_path(run_id, "initial-model")
        write_safetensors(store, directory, model.state_dict())
        initial = store.url_of(directory)
        log.info("the model (%d MB) goes to the ranks through %s", size // 2 ** 20, initial)
    return pretrained.skeleton(model), initial


class _FitPolicy(ElasticPolicy):
    """An elastic fit: ranks that stopped when asked return a paused RankResult; a non-finite
    loss is final (another launch would meet it again); each launch resumes from the newest checkpoint."""

    def __init__(self, how: ElasticLaunch, launch_once: Callable[[LaunchPlan, Relaunches], List[Any]],
                 replan: Callable[[int], LaunchPlan], say: Callable[[str], None], store, run_id: str):
        super().__init__(how)
        self._launch_once, self._replan, self._say = launch_once, replan, say
        self.store, self.run_id = store, run_id

    def launch(self, launch_plan: LaunchPlan, counts: Relaunches) -> List[Any]:
        return self._launch_once(launch_plan, counts)

    def replan(self, size: int) -> LaunchPlan:
        return self._replan(size)

    def is_paused(self, results: List[Any]) -> bool:
        return results[0].paused

    def is_final(self, exc: BaseException) -> bool:
        return isinstance(exc, RankFailedError) and exc.raised(NonFiniteLossError)

    def resume_point(self) -> str:
        return resume_point(self.store, self.run_id)

    def say(self, message: str) -> None:
        super().say(message)
        self._say(message)


def rank_function(cfg: TrainConfig) -> Callable[[TrainConfig], Optional[RankResult]]:
    """What every rank runs: the estimator's loop, or Lightning's Trainer where the fit asks for it
    (imported only then: Lightning is optional).

    >>> rank_function(cfg).__name__  # doctest: +SKIP
    'train_rank'
    """
    if cfg.lightning_trainer is None:
        return train_rank
    from ..trainer.lightning_trainer import fit_with_trainer

    return fit_with_trainer


def launch_fit(spark, config: EstimatorConfig, cfg: TrainConfig, *, decided: FitDecisions,
               on_event: Callable[[int, Any], None], say: Callable[[str], None]) -> RankResult:
    """Train on the ranks the plan decided (again, with the ranks there are, for an elastic fit);
    rank 0's result. A non-finite loss raises TrainingError naming the epoch, step and rank.

    >>> launch_fit(spark, est.config(), cfg, decided=decided, on_event=on_event, say=print).history  # doctest: +SKIP
    """
    verbose = config.verbose
    # the timeline Param: every rank records its spans, the launch merges them into this file
    trace_env = {environment.TIMELINE: config.timeline} if config.timeline is not None else None

    def launch_once(now: LaunchPlan, counts: Optional[Relaunches]) -> List[Any]:
        # validation splits its rows among the ranks there are: its steps follow their number
        run_cfg = cfg if cfg.elastic is None or counts is None else dataclasses.replace(
            cfg, elastic=dataclasses.replace(cfg.elastic, relaunches=counts),
            val_steps=steps_per_epoch(config, cfg.dataset, cfg.parallel.data_size(now.num_proc))[1])
        return launch(spark, now, rank_function(run_cfg), args=(run_cfg,), timeout=config.timeout,
                      start_timeout=config.start_timeout, verbose=2 if verbose >= 2 else (1 if verbose else 0),
                      on_event=on_event, env=trace_env, heartbeat_timeout=config.heartbeat_timeout,
                      names=ESTIMATOR_NAMES)

    try:
        if cfg.elastic is None:
            return launch_once(decided.plan, None)[0]
        # the driver launches again when ranks are lost, not Spark's stage retry (same size only)
        how = ElasticLaunch(cfg.elastic.target_size, cfg.elastic.min_size, config.max_restarts,
                            config.start_timeout, start_timeout_name="startTimeout", min_size_name="minProc",
                            ranks_per_task=decided.plan.ranks_per_task, ranks_per_replica=cfg.parallel.group_size)
        policy = _FitPolicy(how, launch_once, lambda n: dataclasses.replace(plan_launch(config, spark, n), attempts=1),
                            say, cfg.store, cfg.run_id)
        return relaunch_until_done(spark, dataclasses.replace(decided.plan, attempts=1), policy,
                                   stop_request(cfg.store, cfg.run_id))[0]
    except RankFailedError as exc:
        if not exc.raised(NonFiniteLossError):
            raise
        raise TrainingError(exc.rank, exc.remote_traceback, exc.message or "non-finite loss") from None
