"""Horovod's Lightning ``TorchEstimator`` over sparkring's estimator: a LightningModule is fitted by
Lightning's own Trainer on every rank, as Horovod fits it (its callbacks, logger, profiler and
``trainer_args``; steps given ``{column: tensor}`` batches, the ``lightningBatch="dict"`` Param), on
sparkring's ranks, reader and store (trainer/lightning_trainer.py). A plain module given with
``optimizer`` and ``loss`` trains in sparkring's loop, as the torch estimator trains it.

>>> est = TorchEstimator(num_proc=2, model=lightning_module, input_shapes=[[-1, 2]], feature_cols=["features"],
...                      label_cols=["y"], batch_size=4, epochs=2, trainer_args={"num_sanity_val_steps": 0})
... # doctest: +SKIP
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional

from typing_extensions import override

from ...errors import ConfigurationError
from ...estimator.fitting import FitContext
from ...trainer.config import LightningTrainerSettings
from ...trainer.lightning import is_lightning_module
from ...trainer.lightning_trainer import stored_checkpoint
from ..torch.estimator import TorchEstimator as PlainTorchEstimator
from ..torch.estimator import say_not_used

log = logging.getLogger(__name__)

MIN_PL_VERSION = "2.4"  # the oldest PyTorch Lightning this estimator runs (Horovod's name; its own was 1.3.8)

# Lightning Trainer arguments -> the SparkRingEstimator Param that means the same
TRAINER_ARGS = {"max_epochs": "epochs", "accumulate_grad_batches": "backwardPassesPerStep",
                "gradient_clip_val": "gradientClipNorm", "limit_train_batches": "trainStepsPerEpoch",
                "limit_val_batches": "validationStepsPerEpoch"}


@dataclass(frozen=True)
class LightningSettings:
    """Horovod's Lightning keywords that sparkring's loop has no use for, kept for their getters."""

    trainer_args: Dict[str, Any] = field(default_factory=dict)
    num_gpus: Optional[int] = None
    logger: Any = None
    log_every_n_steps: int = 50
    loader_num_epochs: Optional[int] = None
    terminate_on_nan: bool = False
    profiler: Any = None
    debug_data_loader: bool = False
    train_async_data_loader_queue_size: Optional[int] = None
    val_async_data_loader_queue_size: Optional[int] = None
    mp_start_method: Optional[str] = None


def trainer_params(trainer_args: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The Trainer arguments that have a sparkring Param, as Params (whole-number limits only): the
    driver decides the epochs and the steps of each rank's epoch from them. The Trainer gets every
    argument as given.

    >>> trainer_params({"max_epochs": 3, "num_sanity_val_steps": 0})
    {'epochs': 3}
    """
    return {TRAINER_ARGS[name]: value for name, value in (trainer_args or {}).items()
            if name in TRAINER_ARGS and not (name.startswith("limit_") and isinstance(value, float))}


class TorchEstimator(PlainTorchEstimator):
    """Horovod's ``horovod.spark.lightning.TorchEstimator``: every keyword of Horovod's, a
    LightningModule given ``{column: tensor}`` batches, a plain module trained with ``optimizer``
    and ``loss`` as the torch estimator trains it.

    >>> est = TorchEstimator(num_proc=2, model=XOR(), input_shapes=[[-1, 2]], feature_cols=["features"],
    ...                      label_cols=["y"], validation=0.2, batch_size=4, epochs=2)  # doctest: +SKIP
    """

    def __init__(self, num_proc=None, model=None, backend=None, store=None, optimizer=None, loss=None,
                 loss_constructors=None, metrics=None, loss_weights=None, sample_weight_col=None,
                 gradient_compression=None, feature_cols=None, input_shapes=None, validation=None, label_cols=None,
                 callbacks=None, batch_size=None, val_batch_size=None, epochs=None, verbose=1, random_seed=None,
                 shuffle_buffer_size=None, shuffle=True, partitions_per_process=None, run_id=None,
                 train_minibatch_fn=None, train_steps_per_epoch=None, validation_steps_per_epoch=None,
                 transformation_fn=None, transformation_edit_fields=None, transformation_removed_fields=None,
                 train_reader_num_workers=None, trainer_args=None, val_reader_num_workers=None,
                 reader_pool_type=None, label_shapes=None, inmemory_cache_all=False, num_gpus=None, logger=None,
                 log_every_n_steps=50, data_module=None, loader_num_epochs=None, terminate_on_nan=False,
                 profiler=None, debug_data_loader=False, train_async_data_loader_queue_size=None,
                 val_async_data_loader_queue_size=None, use_gpu=True, mp_start_method=None):
        super().__init__(num_proc=num_proc, data_module=data_module, model=model, backend=backend, store=store,
                         optimizer=optimizer, loss=loss, loss_constructors=loss_constructors, metrics=metrics,
                         loss_weights=loss_weights, sample_weight_col=sample_weight_col,
                         gradient_compression=gradient_compression, feature_cols=feature_cols,
                         input_shapes=input_shapes, validation=validation, label_cols=label_cols,
                         callbacks=callbacks, batch_size=batch_size, val_batch_size=val_batch_size, epochs=epochs,
                         verbose=verbose, random_seed=random_seed, shuffle_buffer_size=shuffle_buffer_size,
                         shuffle=shuffle, partitions_per_process=partitions_per_process, run_id=run_id,
                         train_minibatch_fn=train_minibatch_fn, train_steps_per_epoch=train_steps_per_epoch,
                         validation_steps_per_epoch=validation_steps_per_epoch, transformation_fn=transformation_fn,
                         train_reader_num_workers=train_reader_num_workers,
                         val_reader_num_workers=val_reader_num_workers, reader_pool_type=reader_pool_type,
                         label_shapes=label_shapes, inmemory_cache_all=inmemory_cache_all, use_gpu=use_gpu,
                         mp_start_method=None)
        say_not_used({"transformation_edit_fields": transformation_edit_fields,
                      "transformation_removed_fields": transformation_removed_fields})
        if use_gpu and num_gpus == 0:
            self._set(useGpu=False)
        self.lightning = LightningSettings(
            dict(trainer_args or {}), num_gpus, logger, log_every_n_steps, loader_num_epochs, terminate_on_nan,
            profiler, debug_data_loader, train_async_data_loader_queue_size, val_async_data_loader_queue_size,
            mp_start_method)
        self._set(lightningBatch="dict", **trainer_params(trainer_args))

    def _set(self, **kwargs: Any):
        if "model" in kwargs and kwargs["model"] is not None and is_lightning_module(kwargs["model"]):
            kwargs.setdefault("learningRateScaling", "none")  # Horovod leaves a LightningModule's optimizer as it is
        return super()._set(**kwargs)

    def _keep(self, **changes: Any) -> "TorchEstimator":
        self.lightning = replace(self.lightning, **changes)
        return self

    # -- Horovod's getters and setters of the Lightning keywords ------------------------
    def getTrainerArgs(self) -> Dict[str, Any]:
        """The Trainer arguments given."""
        return self.lightning.trainer_args

    def setTrainerArgs(self, value: Dict[str, Any]) -> "TorchEstimator":
        """Trainer arguments; those with a sparkring Param set it."""
        self._set(**trainer_params(value))
        return self._keep(trainer_args=dict(value or {}))

    def getMpStartMethod(self) -> Optional[str]:
        """The multiprocessing start method given (sparkring decides its own)."""
        return self.lightning.mp_start_method

    def setMpStartMethod(self, value: Optional[str]) -> "TorchEstimator":
        """Keep a multiprocessing start method (sparkring decides its own)."""
        return self._keep(mp_start_method=value)

    def getTerminateOnNan(self) -> bool:
        """Whether training stops at a non-finite loss (sparkring always raises there unless
        onNonFinite='skip_step')."""
        return self.lightning.terminate_on_nan

    def setTerminateOnNan(self, value: bool) -> "TorchEstimator":
        """Stop at a non-finite training loss (a LightningModule's Trainer checks each step, as
        Lightning 1.x did; a plain module: sparkring's onNonFinite='raise')."""
        if value:
            self._set(onNonFinite="raise")
        return self._keep(terminate_on_nan=bool(value))

    def getNumGPUs(self) -> Optional[int]:
        """The number of GPUs given."""
        return self.lightning.num_gpus

    def getLogger(self) -> Any:
        """The Lightning logger given (not used: sparkring logs to MLflow)."""
        return self.lightning.logger

    def getLogEveryNSteps(self) -> int:
        """Lightning's log_every_n_steps given."""
        return self.lightning.log_every_n_steps

    def getProfiler(self) -> Any:
        """The profiler given (sparkring's own is the ``timeline`` Param)."""
        return self.lightning.profiler

    def _read_checkpoint(self, run_id: str) -> Optional[str]:
        """Horovod's Lightning name for where a fit with ``run_id`` resumes: Lightning's checkpoint
        of the run in the store for a LightningModule."""
        config = self.config()
        if not is_lightning_module(config.model):
            return self._load_checkpoint(run_id)
        stored = stored_checkpoint(config.store, run_id) if config.store is not None else None
        return stored if stored is not None and config.store.exists(stored) else None

    @override
    def _fit_context(self, dataset) -> FitContext:
        context = super()._fit_context(dataset)
        config = context.config
        if not is_lightning_module(config.model):
            _refuse_lightning_callbacks(config.callbacks)
            return context
        settings = LightningTrainerSettings(
            callbacks=tuple(config.callbacks or ()), trainer_args=dict(self.lightning.trainer_args),
            logger=self.lightning.logger, profiler=self.lightning.profiler,
            log_every_n_steps=self.lightning.log_every_n_steps, terminate_on_nan=self.lightning.terminate_on_nan)
        return replace(context, config=replace(config, callbacks=None), lightning_trainer=settings)

    @override
    def _resume_point(self, run_id: str) -> Optional[str]:
        return self._read_checkpoint(run_id)  # Horovod's LightningEstimator asks under this name


def _refuse_lightning_callbacks(callbacks: Any) -> None:
    """A plain module trains in sparkring's loop, which has no Trainer for a Lightning callback's hooks."""
    for callback in callbacks or []:
        if any(c.__name__ == "Callback" and "lightning" in c.__module__ for c in type(callback).__mro__):
            raise ConfigurationError(
                f"callbacks: {type(callback).__name__} is a Lightning Callback, whose hooks need Lightning's Trainer, "
                "which fits LightningModules only; give the model as a LightningModule, or use earlyStopping=, or "
                "callbacks with on_epoch_end(epoch, logs)")
