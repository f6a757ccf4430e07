"""One rank's fit of a LightningModule by Lightning's own Trainer (Horovod's Lightning estimator):
the Trainer's callbacks, logger, profiler and arguments as the user gave them; the ranks, rows and
store sparkring's.

Lightning's DDP runs on the ranks the runner started (``sparkring.lightning.SparkRingEnvironment``);
each epoch every rank gets the same number of batches from sparkring's reader (DDP needs that), as
the module's steps take them (``{column: tensor}`` for Horovod). Rank 0 reports the epochs to the
driver, keeps Lightning's checkpoint of the run in the store (a later fit with the same run id
resumes from it, as Horovod's does) and writes the fitted weights, as the estimator's loop does
(trainer.loop). Horovod's modules and callbacks were written for Lightning 1.x: a module's
``training_epoch_end``/``validation_epoch_end(outputs)``, which Lightning 2 refuses, and a
callback's ``on_epoch_end``/``on_init_start``..., which it no longer calls, are called as 1.x did,
and the Trainer argument ``stochastic_weight_avg`` becomes the callback it became in Lightning 2.

>>> sparkring.run(fit_with_trainer, args=(cfg,), num_proc=2)[0].history  # doctest: +SKIP
[{'epoch': 0, 'train_loss': 0.69, 'val_loss': 0.68, 'num_proc': 2}]
"""
from __future__ import annotations

import logging
import os
import tempfile
import warnings
from typing import Any, Dict, Iterator, List, Optional

import torch

import sparkring.collective as sr
from sparkring.errors import NonFiniteLossError
from sparkring.runner import report

from . import saving
from .batches import run_batches
from .config import LightningTrainerSettings, TrainConfig
from .events import EpochDone, FitBegan, to_payload
from .lightning import module_batch
from .loop import RankResult
from .placement import whole_model

try:  # the pytorch-lightning package, or the unified lightning package
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover - depends on what is installed
    import lightning.pytorch as pl  # type: ignore[no-redef]

log = logging.getLogger(__name__)

CHECKPOINT = "last"  # Lightning's checkpoint of the run: <store checkpoints>/lightning/last.ckpt
LEGACY_CALLBACK_HOOKS = ("on_init_start", "on_init_end", "on_epoch_start", "on_epoch_end")  # gone in Lightning 2
LEGACY_EPOCH_ENDS = {"training_epoch_end": ("training_step", "on_train_epoch_end"),
                     "validation_epoch_end": ("validation_step", "on_validation_epoch_end")}


def stored_checkpoint(store: Any, run_id: str) -> str:
    """Where the run's Lightning checkpoint lies in the store.

    >>> stored_checkpoint(store, "run01")  # doctest: +SKIP
    '/tmp/work/runs/run01/checkpoints/lightning/last.ckpt'
    """
    return store.checkpoint_path(run_id, "lightning", f"{CHECKPOINT}.ckpt")


def fit_with_trainer(cfg: TrainConfig) -> Optional[RankResult]:
    """Fit ``cfg.model`` (a LightningModule) with Lightning's Trainer on this rank; rank 0 returns
    where the fitted weights lie and the epochs' figures.

    >>> sparkring.run(fit_with_trainer, args=(cfg,), num_proc=2)  # doctest: +SKIP
    """
    settings = cfg.lightning_trainer
    assert settings is not None, "fit_with_trainer fits what TrainConfig.lightning_trainer describes"
    device = sr.rank_device(cfg.use_gpu)
    pl.seed_everything(cfg.seed, verbose=False)
    # the batches come from this process (no loader workers), so RankBatches' length is exact
    warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")
    module = as_lightning2(whole_model(cfg.model, device, cfg.seed))
    report_epochs = EpochReport(cfg.epochs, cfg.train_steps)
    with tempfile.TemporaryDirectory(prefix="sparkring-lightning-") as out:
        checkpoints = os.path.join(out, "checkpoints")
        trainer = pl.Trainer(**trainer_arguments(cfg, settings, device, out, report_epochs))
        resume = _fetch_checkpoint(cfg, checkpoints)
        trainer.fit(module, train_dataloaders=_loader(cfg, "train"),
                    val_dataloaders=_loader(cfg, "val") if cfg.val_steps else None, ckpt_path=resume)
        if sr.rank() != 0:
            return None
        _keep_in_store(cfg, out, checkpoints)
        weights = cfg.store.model_path(cfg.run_id)
        saving.clear(cfg.store, weights)
        saving.write_safetensors(cfg.store, weights, _fitted_state(module, settings))
    return RankResult(weights=weights, history=report_epochs.history, output_shapes=None)


def trainer_arguments(cfg: TrainConfig, settings: LightningTrainerSettings, device: torch.device, out: str,
                      report_epochs: Any) -> Dict[str, Any]:
    """The Trainer's arguments: Horovod's (its epochs, callbacks, logger, profiler, no sanity
    validation), on the ranks sparkring placed; ``trainer_args`` win, as in Horovod.

    >>> pl.Trainer(**trainer_arguments(cfg, settings, torch.device("cpu"), "/tmp/out", report))  # doctest: +SKIP
    """
    from sparkring.lightning import SparkRingEnvironment, trainer_layout

    ModelCheckpoint = pl.callbacks.ModelCheckpoint

    checkpoints = os.path.join(out, "checkpoints")
    callbacks: List[Any] = list(settings.callbacks)
    for callback in callbacks:
        if isinstance(callback, ModelCheckpoint):
            callback.dirpath = checkpoints  # as Horovod does: the run's own place, kept in the store at the end
    callbacks.append(RunCheckpoint(dirpath=checkpoints, filename=CHECKPOINT, enable_version_counter=False))
    legacy = [c for c in callbacks if any(callable(getattr(c, hook, None)) for hook in LEGACY_CALLBACK_HOOKS)]
    if legacy:
        callbacks.append(Lightning1Hooks(legacy))
    trainer_args = dict(settings.trainer_args)
    if trainer_args.pop("stochastic_weight_avg", False):
        callbacks.append(Lightning1SWA())
    if settings.terminate_on_nan:
        callbacks.append(StopOnNonFinite())
    callbacks.append(report_epochs)
    cuda = device.type == "cuda"
    logs = os.path.join(out, "logs")
    logger = in_run_logs(settings.logger, logs) if settings.logger is not None else pl.loggers.TensorBoardLogger(logs)
    arguments = dict(
        accelerator="gpu" if cuda else "cpu", **trainer_layout(),
        strategy=pl.strategies.DDPStrategy(cluster_environment=SparkRingEnvironment(),
                                           process_group_backend="nccl" if cuda else "gloo"),
        max_epochs=cfg.epochs, callbacks=callbacks, precision=cfg.precision, default_root_dir=out,
        logger=logger, log_every_n_steps=settings.log_every_n_steps, profiler=settings.profiler, num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    if cfg.gradient_clip_norm is not None:
        arguments["gradient_clip_val"] = cfg.gradient_clip_norm
    arguments.update(trainer_args)
    return arguments


def in_run_logs(logger: Any, logs: str) -> Any:
    """A user's logger that writes files, writing them under ``logs`` (kept in the run's logs in the
    store), as Horovod's remote trainer sets its ``save_dir``; a logger of a service (MLflow, W&B,
    Comet) logs where it was told.

    Lightning 2's file loggers give ``save_dir`` no setter: the directory behind it is set on the
    rank's own copy of the logger (it arrived pickled), before its experiment is made.

    >>> in_run_logs(pl.loggers.CSVLogger("/tmp/mine"), "/tmp/run/logs").save_dir  # doctest: +SKIP
    '/tmp/run/logs'
    """
    if not isinstance(logger, (pl.loggers.TensorBoardLogger, pl.loggers.CSVLogger)):
        return logger
    if sr.rank() == 0:
        log.info("logger %s writes into the run's logs (%s), as Horovod moves its save_dir", type(logger).__name__,
                 logs)
    logger._root_dir = logs
    if hasattr(logger, "_save_dir"):
        logger._save_dir = logs
    return logger


class RankBatches(torch.utils.data.IterableDataset):
    """One split's batches for this rank, ``steps`` of them each time Lightning reads it (a new
    epoch's order each time), as the module's steps take them.

    >>> next(iter(RankBatches(cfg, "train", cfg.train_steps)))  # doctest: +SKIP
    {'features': tensor([[0., 1.], ...]), 'y': tensor([1., ...])}
    """

    def __init__(self, cfg: TrainConfig, split: str, steps: int):
        super().__init__()
        self.cfg, self.split, self.steps = cfg, split, steps
        self.passes = 0

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Any]:
        cfg, training = self.cfg, self.split == "train"
        epoch, self.passes = self.passes, self.passes + 1
        cpu = torch.device("cpu")  # Lightning moves the batch to the rank's device
        for batch in run_batches(cfg, self.split, batch_size=cfg.batch_size if training else cfg.val_batch_size,
                                 rank=sr.rank(), size=sr.size(), epoch=epoch, steps=self.steps,
                                 shuffle=cfg.shuffle and training, drop_last=training, workers=0, device=cpu):
            yield module_batch(cfg.spec, cfg.spec.labels, batch, cfg.lightning_batch, cpu)[0]


def _loader(cfg: TrainConfig, split: str) -> torch.utils.data.DataLoader:
    steps = cfg.train_steps if split == "train" else cfg.val_steps
    return torch.utils.data.DataLoader(RankBatches(cfg, split, steps), batch_size=None)


class EpochReport(pl.Callback):
    """Each epoch's figures (what the module logged, over every rank), into the history and, from
    rank 0, to the driver's epoch lines."""

    def __init__(self, epochs: int, steps: int):
        self.epochs, self.steps = epochs, steps
        self.history: List[Dict[str, Any]] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Rank 0 tells the driver the fit began (and the epoch it resumed at)."""
        if trainer.global_rank == 0:
            report(to_payload(FitBegan(epochs=self.epochs, start_epoch=trainer.current_epoch, steps=self.steps)))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """The epoch's figures (Lightning ran validation before this hook)."""
        logs: Dict[str, Any] = {"epoch": trainer.current_epoch}
        for name, value in trainer.callback_metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                logs[name] = float(value)
        logs["num_proc"] = trainer.world_size
        self.history.append(logs)
        if trainer.global_rank == 0:
            report(to_payload(EpochDone(epoch=trainer.current_epoch, logs=logs, stopped=trainer.should_stop)))


class Lightning1Hooks(pl.Callback):
    """The Lightning 1.x hooks of callbacks written for Horovod, which Lightning 2 no longer calls:
    ``on_init_start``/``on_init_end`` once the Trainer is built, ``on_epoch_start``/``on_epoch_end``
    around each training and each validation epoch, as 1.x called them.

    >>> Lightning1Hooks([MyDummyCallback()])  # doctest: +SKIP
    """

    def __init__(self, callbacks: List[Any]):
        self.callbacks = callbacks

    def _call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            if callable(getattr(callback, hook, None)):
                getattr(callback, hook)(*args)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """1.x's on_init_start and on_init_end (the Trainer is built by now)."""
        self._call("on_init_start", trainer)
        self._call("on_init_end", trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """1.x's on_epoch_start of a training epoch."""
        self._call("on_epoch_start", trainer, pl_module)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """1.x's on_epoch_end of a training epoch."""
        self._call("on_epoch_end", trainer, pl_module)

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """1.x's on_epoch_start of a validation epoch."""
        self._call("on_epoch_start", trainer, pl_module)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """1.x's on_epoch_end of a validation epoch."""
        self._call("on_epoch_end", trainer, pl_module)


class RunCheckpoint(pl.callbacks.ModelCheckpoint):
    """The run's own checkpoint after every epoch (``last.ckpt``), where a later fit with the same run
    id resumes, beside any ModelCheckpoint of the user's (Lightning keeps one checkpoint callback
    per ``state_key``: this one has its own).

    >>> RunCheckpoint(dirpath="/tmp/out/checkpoints", filename="last")  # doctest: +SKIP
    """

    @property
    def state_key(self) -> str:
        """Lightning's key of this callback's state in a checkpoint: apart from the user's."""
        return f"sparkring-run-{super().state_key}"


class StopOnNonFinite(pl.Callback):
    """Lightning 1.x's ``terminate_on_nan``: a non-finite training loss ends the fit, naming the
    epoch, step and rank (the driver raises TrainingError).

    >>> Trainer(callbacks=[StopOnNonFinite()])  # doctest: +SKIP
    """

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Raise where the step's loss is not finite."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss).all()):
            value = float(loss.float().mean())
            raise NonFiniteLossError(f"non-finite loss {value:g} at epoch {trainer.current_epoch}, step {batch_idx} "
                                     f"on rank {trainer.global_rank} (terminate_on_nan)")


class Lightning1SWA(pl.callbacks.StochasticWeightAveraging):
    """Lightning 1.x's ``Trainer(stochastic_weight_avg=True)``: weights averaged from 80% of the
    epochs at the rates the optimizer has when averaging starts (1.x's ``swa_lrs=None``; Lightning
    2 asks for the rates up front).

    >>> Trainer(callbacks=[Lightning1SWA()])  # doctest: +SKIP
    """

    def __init__(self):
        super().__init__(swa_lrs=1.0)  # a placeholder: the optimizer's rates replace it when averaging starts

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Take the optimizer's rates at the epoch averaging starts, then Lightning's own hook."""
        if not self._initialized and self.swa_start <= trainer.current_epoch <= self.swa_end:
            self._swa_lrs = [group["lr"] for group in trainer.optimizers[0].param_groups]
        super().on_train_epoch_start(trainer, pl_module)


def as_lightning2(module: Any) -> Any:
    """``module`` with its Lightning 1.x ``training_epoch_end``/``validation_epoch_end(outputs)``
    called as 1.x did (at the end of the epoch's training or validation, with the outputs of its
    steps) from Lightning 2's hooks; a module without them is returned as it is.

    >>> as_lightning2(HorovodXOR()).validation_epoch_end is None  # doctest: +SKIP
    True
    """
    original = type(module)
    legacy = {hook: hooks for hook, hooks in LEGACY_EPOCH_ENDS.items() if callable(getattr(module, hook, None))}
    if not legacy:
        return module
    namespace: Dict[str, Any] = {hook: None for hook in legacy}  # Lightning 2 refuses a module defining them
    for hook, (step, epoch_end) in legacy.items():
        namespace[step] = _collecting(getattr(original, step), hook)
        namespace[epoch_end] = _handing_over(getattr(original, epoch_end), getattr(original, hook), hook)
    log.info("%s defines %s (Lightning 1.x): called with its steps' outputs from Lightning 2's epoch-end hooks",
             original.__name__, " and ".join(legacy))
    module.__class__ = type(original.__name__, (original,), namespace)
    return module


def _collecting(step: Any, hook: str) -> Any:
    def collect(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = step(self, *args, **kwargs)
        kept = out.detach() if isinstance(out, torch.Tensor) else (
            {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()} if isinstance(out, dict)
            else out)
        self.__dict__.setdefault("_sparkring_step_outputs", {}).setdefault(hook, []).append(kept)
        return out
    return collect


def _handing_over(epoch_end: Any, legacy_end: Any, hook: str) -> Any:
    def end(self: Any) -> None:
        epoch_end(self)
        outputs = self.__dict__.get("_sparkring_step_outputs", {}).pop(hook, [])
        legacy_end(self, [o for o in outputs if o is not None])
    return end


def _fetch_checkpoint(cfg: TrainConfig, local_dir: str) -> Optional[str]:
    """The run's Lightning checkpoint, copied from the store to this rank's disk; None for a new run."""
    stored = stored_checkpoint(cfg.store, cfg.run_id)
    if not cfg.store.exists(stored):
        return None
    os.makedirs(local_dir, exist_ok=True)
    local = os.path.join(local_dir, "resume.ckpt")
    with open(local, "wb") as f:
        f.write(cfg.store.read_bytes(stored))
    if sr.rank() == 0:
        log.info("run %s resumes from Lightning's checkpoint %s", cfg.run_id, stored)
    return local


def _keep_in_store(cfg: TrainConfig, out: str, checkpoints: str) -> None:
    """Rank 0's checkpoints and logs, from its disk into the run's checkpoints and logs in the store."""
    places = [(checkpoints, cfg.store.checkpoint_path(cfg.run_id, "lightning")),
              (os.path.join(out, "logs"), cfg.store.logs_path(cfg.run_id))]
    for local, stored in places:
        for folder, _, files in os.walk(local):
            for name in files:
                path = os.path.join(folder, name)
                if name != "resume.ckpt":
                    with open(path, "rb") as f:
                        cfg.store.write_bytes(os.path.join(stored, os.path.relpath(path, local)), f.read())


def _fitted_state(module: Any, settings: LightningTrainerSettings) -> Dict[str, torch.Tensor]:
    """The weights to return: the best checkpoint's where the user's ModelCheckpoint kept one (as
    Horovod returns it), else the module's at the end."""
    for callback in settings.callbacks:
        if isinstance(callback, pl.callbacks.ModelCheckpoint) and callback.best_model_path:
            return torch.load(callback.best_model_path, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}
