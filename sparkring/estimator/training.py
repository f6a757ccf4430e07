"""The per-rank training loop that SparkRingEstimator.fit runs through sparkring.run."""
from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

import sparkring.collective as sr
from sparkring.collective.elastic import LEAVE
from sparkring.collective.timeline import process_started_us, recorder
from sparkring.data import FeatureSpec
from sparkring.data.reader import prefetched
from sparkring.runner import report

from . import lightning_steps, losses, sharding
from .elastic import ElasticPlan, stop_request
from .events import EpochDone, FitBegan, StepDone, to_payload
from .lightning_steps import Schedule
from .sharding import Sharding

log = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^epoch-(\d{5})(?:-step-(\d{7}))?\.pt$")  # a step: inside the epoch (elastic fits)


@dataclass(frozen=True)
class EarlyStopping:
    """The earlyStopping Param, checked: stop once ``monitor`` has not improved by ``min_delta``
    for ``patience`` epochs (``mode`` "min" or "max")."""

    monitor: str
    patience: int
    mode: str = "min"
    min_delta: float = 0.0


@dataclass
class TrainConfig:
    model: torch.nn.Module
    optimizer: Any
    losses: List[Any]
    metrics: Dict[str, Callable]
    dataset: Any
    store: Any
    run_id: str
    spec: FeatureSpec
    loss_weights: List[float]
    batch_size: int
    val_batch_size: int
    epochs: int
    shuffle: bool
    seed: int
    backward_passes_per_step: int
    compression: str
    lr_scaling: str
    warmup_epochs: float
    train_steps: int                  # steps of each rank's epoch (a multiple of backward_passes_per_step)
    val_steps: int                    # validation steps of each rank's epoch (0: no validation)
    callbacks: List[Any] = field(default_factory=list)
    early_stopping: Optional["EarlyStopping"] = None
    use_gpu: bool = False
    has_validation: bool = False
    transform_fn: Optional[Callable] = None
    reader_workers: Optional[int] = None
    reader: str = "arrow"             # data.READERS
    multi_head: bool = False
    skip_non_finite: bool = False
    lightning: bool = False           # model is a LightningModule (lightning_steps)
    sharding: Sharding = field(default_factory=Sharding)
    precision: str = "32"             # 32 | bf16-mixed | 16-mixed
    compile: Optional[Dict[str, Any]] = None  # torch.compile's options (None: eager)
    elastic: Optional[ElasticPlan] = None     # world-size-independent global batches, checkpoints inside epochs
    timeline: bool = False                    # record each rank's spans for the driver's Chrome trace

    def log_names(self) -> List[str]:
        """Names of the per-epoch figures after 'loss', in the order _Step sums them."""
        if not self.multi_head:
            return list(self.metrics)
        return [f"{label}_{name}" for label in self.spec.labels for name in ["loss"] + list(self.metrics)]


def default_reader_workers(local_size: int) -> int:
    """Decode processes per rank: the cores each rank has left after its training thread, 1 to 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // max(1, local_size) - 1))


NON_FINITE = "non-finite loss"
AMP_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def non_finite_reason(remote_traceback: str) -> Optional[str]:
    """The reason line of a rank that stopped on a non-finite loss, or None for other failures."""
    marker = f"FloatingPointError: {NON_FINITE}"
    for line in reversed(remote_traceback.splitlines()):
        if line.startswith(marker):
            return line[len("FloatingPointError: "):]
    return None


def _grads_finite(model: torch.nn.Module) -> bool:
    """Whether every gradient is finite (one host sync for the whole model)."""
    sums = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        if g.is_sparse:
            g = g.coalesce().values()
        sums.append(g.detach().float().abs().sum())
    return not sums or bool(torch.isfinite(torch.stack(sums).sum()))


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)


class _StepClock:
    """Where an epoch's seconds go on this rank: waiting for the next batch (data), forward,
    backward and the optimizer (compute), blocked in the gradient exchange (comm: replicated
    models, in backward where the transport reduces as it starts and in synchronize; FSDP2's
    exchanges run inside forward and backward and count as compute), the rest."""

    PARTS = ("data", "compute", "comm")

    def __init__(self) -> None:
        self.started = self.mark = time.monotonic()
        self.spent = dict.fromkeys(self.PARTS, 0.0)

    def lap(self, part: str) -> None:
        now = time.monotonic()
        self.spent[part] += now - self.mark
        self.mark = now

    def exchanged(self, seconds: float) -> None:
        """``seconds`` of what was counted as compute were spent blocked in gradient exchanges."""
        self.spent["compute"] -= seconds
        self.spent["comm"] += seconds

    def timed(self, batches: Iterator[Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
        self.mark = time.monotonic()
        waited = recorder.now() if recorder.on else 0.0
        for batch in batches:
            self.lap("data")
            if recorder.on:
                recorder.add("data wait", waited, recorder.now())
            yield batch
            waited = recorder.now() if recorder.on else 0.0

    def seconds(self) -> List[float]:
        """data, compute, comm, other, total."""
        total = time.monotonic() - self.started
        parts = [self.spent[p] for p in self.PARTS]
        return parts + [max(0.0, total - sum(parts)), total]


class _Step:
    """One batch through the model: forward()'s arguments from the spec, one output per
    head, each head's label and loss, the weighted total, and the figures to average."""

    def __init__(self, cfg: TrainConfig, device: torch.device, rank: int):
        self.cfg, self.device, self.rank = cfg, device, rank
        self.first = True
        self.output_shapes: Optional[List[List[int]]] = None
        self.amp_dtype = AMP_DTYPES.get(cfg.precision)

    def autocast(self):
        """Forward and loss in the precision asked for (autocast keeps what needs float32 there)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def width(self) -> int:
        return 2 + len(self.cfg.log_names())

    def __call__(self, model, batch: Dict[str, Any], where: str):
        cfg, device = self.cfg, self.device
        labels = cfg.spec.labels
        try:
            args, kwargs = cfg.spec.model_args(batch)
            args = tuple(a.to(device, non_blocking=True) for a in args)
            kwargs = {k: v.to(device, non_blocking=True) for k, v in kwargs.items()}
            with self.autocast():
                out = model(*args, **kwargs)
                heads = self._heads(out)
                ys = [losses.prepare_label(torch.as_tensor(batch[label]).to(device), head, loss, self.first)
                      for label, head, loss in zip(labels, heads, cfg.losses)]
                w = torch.as_tensor(batch[cfg.spec.weight]).to(device) if cfg.spec.weight else None
                head_losses = [losses.compute_loss(loss, head, y, w) for loss, head, y in zip(cfg.losses, heads, ys)]
        except Exception as exc:
            _add_note(exc, f"sparkring: on rank {self.rank}, {where}")
            raise
        total = head_losses[0] * cfg.loss_weights[0]
        for weight, value in zip(cfg.loss_weights[1:], head_losses[1:]):
            total = total + weight * value
        if self.output_shapes is None:
            self.output_shapes = [list(h.shape[1:]) for h in heads]
        self.first = False
        return total, heads, ys, head_losses

    def _heads(self, out) -> List[torch.Tensor]:
        labels = self.cfg.spec.labels
        if not self.cfg.multi_head:
            return [out]
        if not isinstance(out, (tuple, list)) or len(out) < len(labels):
            got = len(out) if isinstance(out, (tuple, list)) else 1
            raise ValueError(f"the model returned {got} output(s) but labelCol names {len(labels)} labels "
                             f"{list(labels)}: return a tuple with one output per label, in labelCol's order")
        return list(out[:len(labels)])

    def figures(self, total, heads, ys, head_losses) -> torch.Tensor:
        """Per-batch figures (sums over rows), float64 on the model's device: total loss, rows,
        then log_names()'s values. They stay there: the loop adds them up on the device and
        reads them on the host once per progress report (each read waits for the GPU)."""
        n = heads[0].shape[0]

        def scalar(value) -> torch.Tensor:
            return torch.as_tensor(value).detach().to(self.device, torch.float64).reshape(()) * n

        with torch.no_grad():
            values = [scalar(total), torch.tensor(float(n), dtype=torch.float64, device=self.device)]
            if not self.cfg.multi_head:
                values += [scalar(fn(heads[0].detach(), ys[0])) for fn in self.cfg.metrics.values()]
            else:
                for head, y, value in zip(heads, ys, head_losses):
                    values.append(scalar(value))
                    values += [scalar(fn(head.detach(), y)) for fn in self.cfg.metrics.values()]
        return torch.stack(values)


def checkpoint_names(store, run_id: str) -> List[str]:
    return sorted(n for n in store.listdir(store.checkpoint_path(run_id)) if CHECKPOINT_RE.match(n))


def resume_point(store, run_id: str) -> str:
    """Where a fit launched now resumes, in the console's words: its newest checkpoint's position
    (a sharded one only once complete).

    >>> resume_point(store, "r1")  # epoch-00001-step-0000137.pt  # doctest: +SKIP
    'step 138 of epoch 2'
    """
    names = checkpoint_names(store, run_id) + [
        n for n in sharding.checkpoint_dirs(store, run_id)
        if store.exists(store.checkpoint_path(run_id, n, sharding.TRAINER_STATE))]
    if not names:
        return "the start"
    newest = max(names)  # the names sort by position
    found = CHECKPOINT_RE.match(newest) or sharding.CHECKPOINT_DIR_RE.match(newest)
    assert found is not None  # both listings keep only names their pattern matches
    epoch, step = int(found.group(1)), found.group(2)
    # the name holds the 0-based epoch and the 0-based step to go on at; the console counts from 1
    return f"step {int(step) + 1} of epoch {epoch + 1}" if step is not None else f"the start of epoch {epoch + 2}"


def load_latest_checkpoint(store, run_id: str) -> Optional[Dict[str, Any]]:
    for name in reversed(checkpoint_names(store, run_id)):
        try:
            data = store.read_bytes(store.checkpoint_path(run_id, name))
            # tensors, numbers and strings only: no pickled code runs when a checkpoint loads
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a damaged file: fall back to the one before
            log.warning("checkpoint %s of run %s cannot be loaded (%s); trying the one before", name, run_id, exc)
            continue
    return None


def _save_checkpoint(cfg: TrainConfig, model, opt, trainer_state: Dict[str, Any]) -> None:
    """Rank 0's checkpoint of a replicated model: its weights, the optimizer's state and the
    trainer's (``_Trainer._trainer_state``: after an epoch, or inside it at a step)."""
    buf = io.BytesIO()
    # on CPU, so that a host without the GPU (or with fewer) loads it
    torch.save(_on_cpu({"model": model.state_dict(), "optimizer": opt.state_dict(), **trainer_state}), buf)
    epoch, step = trainer_state["epoch"], trainer_state["step"]
    name = f"epoch-{epoch:05d}" + (f"-step-{step:07d}" if step is not None else "") + ".pt"
    cfg.store.write_bytes(cfg.store.checkpoint_path(cfg.run_id, name), buf.getvalue())
    # keep the two newest: the latest, and the one before in case the latest is cut short
    for old in checkpoint_names(cfg.store, cfg.run_id)[:-2]:
        cfg.store.delete(cfg.store.checkpoint_path(cfg.run_id, old))


def _on_cpu(obj):
    """``obj`` with every tensor in its dicts, lists and tuples copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _on_cpu(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


def _seed_epoch(seed: int, epoch: int, rank: int) -> None:
    # Every epoch starts from RNG state derived from (seed, epoch, rank): a resumed run
    # draws exactly what the uninterrupted one drew.
    s = (seed * 1_000_003 + epoch * 7919 + rank) % (2 ** 31)
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


def _build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if isinstance(cfg.optimizer, torch.optim.Optimizer):
        opt = cfg.optimizer
        model_params = {id(p) for p in model.parameters()}
        if any(id(p) not in model_params for g in opt.param_groups for p in g["params"]):
            raise ValueError("optimizer= was built over parameters that are not the model's; build it with "
                             "model.parameters() of the same model, or pass a factory: lambda params: ...")
        return opt
    opt = cfg.optimizer(model.parameters())
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
    return opt


class _Callbacks:
    def __init__(self, callbacks):
        self.callbacks = list(callbacks or [])

    def call(self, hook: str, *args):
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(*args)
            elif hook == "on_epoch_end" and callable(cb):
                cb(*args[:2])


class _Tensorboard:
    def __init__(self, cfg: TrainConfig):
        self.writer = None
        log_dir = cfg.store.local_path(cfg.store.logs_path(cfg.run_id))
        if log_dir is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:  # noqa: BLE001 - tensorboard is optional
            return
        self.writer = SummaryWriter(log_dir=log_dir)

    def epoch(self, epoch: int, logs: Dict[str, Any]) -> None:
        if self.writer is not None:
            for k, v in logs.items():
                if isinstance(v, (int, float)) and k != "epoch":
                    self.writer.add_scalar(k, v, epoch)
            self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()


def _run_batches(cfg: TrainConfig, split: str, bs: int, rank: int, size: int, epoch: int, steps: int,
                 shuffle: bool, drop_last: bool, workers: int, device: torch.device):
    """``steps`` batches, starting more passes over the data when one pass has fewer (pinned
    ahead when they go to a GPU)."""
    batches = _passes(cfg, split, bs, rank, size, epoch, steps, drop_last, shuffle, workers)
    return pinned(batches) if device.type == "cuda" else batches


def _passes(cfg: TrainConfig, split: str, bs: int, rank: int, size: int, epoch: int, steps: int, drop_last: bool,
            shuffle: bool, workers: int) -> Iterator[Dict[str, Any]]:
    produced = 0
    for extra_pass in itertools.count():
        got = 0
        for batch in cfg.dataset.batches(bs, rank=rank, size=size, shuffle=shuffle, seed=cfg.seed,
                                         epoch=epoch + extra_pass * 100_003, drop_last=drop_last, split=split,
                                         transform=cfg.transform_fn, workers=workers, reader=cfg.reader):
            yield batch
            got += 1
            produced += 1
            if produced >= steps:
                return
        if got == 0 or not drop_last:
            return


def pinned(batches: Iterator[Dict[str, Any]], pin: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.pin_memory,
           depth: int = 2) -> Iterator[Dict[str, Any]]:
    """``batches`` with their tensors copied to page-locked memory on a thread, ``depth``
    batches ahead: a copy from pinned memory to the GPU runs asynchronously (non_blocking),
    from ordinary memory it does not. Stopping early stops the thread.

    >>> next(pinned(iter([{"x": torch.ones(2)}]), pin=torch.Tensor.clone))["x"]
    tensor([1., 1.])
    """
    return prefetched(({k: pin(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                       for batch in batches), depth)


@dataclass
class RankResult:
    """What rank 0 hands back to the driver: the trained weights (on the CPU), the per-epoch
    figures, and the output shape of each head (transform's columns)."""

    state_dict: Dict[str, Any]
    history: List[Dict[str, Any]]
    output_shapes: Any
    timeline: Optional[List[List[Dict[str, Any]]]] = None  # every rank's Chrome-trace events
    paused: bool = False  # stopped at a checkpoint when the driver asked (an elastic fit resizes): no weights


class _Paused(Exception):
    """Every rank stops at the checkpoint it just wrote: the driver launches again from it."""


def train_rank(cfg: TrainConfig) -> Optional[RankResult]:
    """The training loop of one rank (what fit() runs on every rank); rank 0 returns the result."""
    if cfg.timeline:
        recorder.start(sr.rank())
        began, joined = recorder.joined_us
        recorder.add("start-up: join the ring (rendezvous, transports)", began, joined)
        recorder.add("start-up: rank process (fork or spawn, imports) until the ring", process_started_us(), began)
    with recorder.span("start-up: model, optimizer, resume"):
        trainer = _Trainer(cfg)
    trainer.begin()
    try:
        for epoch in range(trainer.start_epoch, cfg.epochs):
            logs = trainer.train_epoch(epoch)
            if trainer.end_epoch(epoch, logs):
                break
    except _Paused:
        return trainer.pause()
    return trainer.finish()


class _Trainer:
    """One rank's fit: the model, optimizer and schedules resumed from the last checkpoint and
    made the same on every rank, then epochs of steps, then rank 0's result."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.rank, self.size = sr.rank(), sr.size()
        self.device = sr.rank_device(cfg.use_gpu)
        self.sharded = cfg.sharding.sharded
        self.model = sharding.build_model(cfg.model, cfg.sharding, self.device, cfg.seed)
        self.checkpointer = (sharding.Checkpointer(cfg.store, cfg.run_id, cfg.sharding.async_checkpoint)
                             if self.sharded else None)
        torch.manual_seed(cfg.seed)
        self.schedules: List[Schedule] = []
        if cfg.lightning:
            opt, self.schedules = lightning_steps.optimizers(self.model)
        else:
            opt = _build_optimizer(cfg, self.model)
        self.history: List[Dict[str, Any]] = []
        self.start_epoch, self.stopped, self.best, self.waited = 0, False, None, 0
        # a checkpoint inside an epoch: the step to go on at, and the epoch's figures until then (every rank's)
        self.start_step, self.epoch_sums = 0, None
        self._resume(opt)
        self.base_lrs = [g["lr"] for g in opt.param_groups]
        # FSDP2 reduce-scatters the gradients itself; replicated models allreduce them in buckets
        self.opt = opt if self.sharded else sr.DistributedOptimizer(
            opt, named_parameters=self.model.named_parameters(), compression=getattr(sr.Compression, cfg.compression),
            backward_passes_per_step=cfg.backward_passes_per_step)
        self.steps, self.val_steps = cfg.train_steps, cfg.val_steps  # the driver decided them for every rank
        # the compiled module runs the steps; the module itself keeps the weights that are saved
        self.runs = torch.compile(self.model, **cfg.compile) if cfg.compile is not None else self.model
        self.first_step_s: Optional[float] = None
        self.clock = _StepClock()
        self.state_sizes = (0, 0)  # (parameters + optimizer state, gradients) in bytes, at the epoch's last update
        # float16 needs its loss scaled; bfloat16 has float32's range and does not
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.precision == "16-mixed" else None
        self.workers = 0
        if cfg.transform_fn is not None:
            self.workers = (cfg.reader_workers if cfg.reader_workers is not None
                            else default_reader_workers(sr.local_size()))
        self.step: Any = _Step(cfg, self.device, self.rank)
        if cfg.lightning:
            self.step = lightning_steps.LightningStep(cfg.spec.labels, cfg.spec, self.device, self.rank, _add_note)
            self.step.attach(self.model)
            self.model.on_fit_start()
        self.callbacks = _Callbacks(cfg.callbacks if self.rank == 0 else [])
        # what the driver asks of an elastic fit (elastic.GROW, LEAVE), agreed by every rank after each step
        self.stop_request = stop_request(cfg.store, cfg.run_id) if cfg.elastic is not None else None
        self.asked, self.next_look = 0, 0.0
        self.board = _Tensorboard(cfg) if self.rank == 0 else None

    def _resume(self, opt) -> None:
        """Rank 0 reads the last checkpoint; every rank then starts from rank 0's state (a sharded
        model: every rank loads its shards of the last sharded checkpoint)."""
        if self.sharded:
            state = sharding.load_latest_checkpoint(self.cfg.store, self.cfg.run_id, self.model, opt)
            if state is not None:
                self._restore_trainer(state)
            return
        resumed = False
        if self.rank == 0:
            ckpt = load_latest_checkpoint(self.cfg.store, self.cfg.run_id)
            if ckpt is not None:
                self.model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["optimizer"])
                self._restore_trainer(ckpt)
                resumed = True
        self.start_epoch, self.start_step, self.epoch_sums, self.history, self.stopped, resumed = sr.broadcast_object(
            (self.start_epoch, self.start_step, self.epoch_sums, self.history, self.stopped, resumed), root_rank=0)
        sr.broadcast_parameters(self.model.state_dict(), root_rank=0)
        if not resumed:
            return  # fresh optimizers are alike: making state to broadcast would count an extra Adam step
        sr.broadcast_optimizer_state(opt, root_rank=0)
        for schedule in self.schedules:
            schedule.scheduler.load_state_dict(sr.broadcast_object(schedule.scheduler.state_dict(), root_rank=0))

    def begin(self) -> None:
        if self.rank == 0:
            report(to_payload(FitBegan(epochs=self.cfg.epochs, start_epoch=self.start_epoch, steps=self.steps)))
            self.callbacks.call("on_train_begin", self.model)
        if self.stopped:
            self.start_epoch = self.cfg.epochs  # a resumed run that had already stopped early

    def _scale_lr(self, epoch: int, i: int) -> None:
        cfg = self.cfg
        global_step = (epoch * self.steps + i) // cfg.backward_passes_per_step
        warm = max(1.0, cfg.warmup_epochs * self.steps / cfg.backward_passes_per_step)
        size = cfg.elastic.target_size if cfg.elastic is not None else self.size  # the global batch's ranks
        factor = 1 + (size - 1) * min(1.0, global_step / warm) if cfg.warmup_epochs > 0 else size
        for g, lr in zip(self.opt.param_groups, self.base_lrs):
            g["lr"] = lr * factor

    def _blocked_s(self) -> float:
        """Seconds blocked in gradient exchanges so far (a sharded model's run inside its forward
        and backward, and count as compute)."""
        return 0.0 if self.sharded else self.opt.exchange_seconds

    def _update(self, epoch: int, i: int) -> int:
        """The optimizer step after backward_passes_per_step batches; 1 where a non-finite
        update was skipped."""
        cfg, opt, skipped = self.cfg, self.opt, 0
        if self.scaler is not None:
            skipped = self._scaled_update()
        elif cfg.skip_non_finite and self.sharded:
            if sharding.grads_finite(self.model):
                opt.step()
            else:
                skipped = 1
        elif cfg.skip_non_finite:
            opt.synchronize()
            if _grads_finite(self.model):
                with opt.skip_synchronize():
                    opt.step()
            else:
                skipped = 1
        elif self.sharded:
            opt.step()
        else:
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        if i + 1 == self.steps:  # the state is whole now (gradients and optimizer moments): measured once an epoch
            self.state_sizes = sharding.state_bytes(self.model, opt)
        opt.zero_grad()
        updates = (epoch * self.steps + i + 1) // cfg.backward_passes_per_step
        for schedule in self.schedules:
            if schedule.interval == "step" and updates % schedule.frequency == 0:
                schedule.step()
        return skipped

    def train_epoch(self, epoch: int) -> Dict[str, Any]:
        """One epoch of steps; its figures over every rank (and validation's)."""
        cfg, rank, model, step = self.cfg, self.rank, self.model, self.step
        _seed_epoch(cfg.seed, epoch, rank)
        model.train()
        if cfg.lightning:
            model.on_train_epoch_start()
        first, self.start_step = self.start_step, 0  # a run resumed inside this epoch goes on at its next step
        sums = torch.zeros(step.width(), dtype=torch.float64, device=self.device)
        if first and rank == 0 and self.epoch_sums:  # every rank's figures before the checkpoint, counted once
            sums += torch.tensor(self.epoch_sums, dtype=torch.float64, device=self.device)
        # an elastic fit's rank trains on its share of a global batch: weighted, the ranks' mean is the batch's
        weight = cfg.elastic.gradient_weight(rank, self.size) if cfg.elastic is not None else 1.0
        skipped = 0
        last_report = 0.0
        self.clock = clock = _StepClock()
        for i, batch in enumerate(clock.timed(self._batches(epoch, first)), start=first):
            step_began = recorder.now() if recorder.on else 0.0
            if cfg.lr_scaling == "linear":
                self._scale_lr(epoch, i)
            started = time.monotonic() if self.first_step_s is None else 0.0
            blocked = self._blocked_s()
            with recorder.span("forward"):
                loss, heads, ys, head_losses = step(self.runs, batch, f"epoch {epoch}, training batch {i}")
                figures = step.figures(loss, heads, ys, head_losses)
            # the one host sync of a step: whether training may go on decides the step
            finite = bool(torch.isfinite(figures[0]))
            if not finite and not cfg.skip_non_finite:
                raise FloatingPointError(f"{NON_FINITE} {float(figures[0] / figures[1]):g} at epoch {epoch}, "
                                         f"step {i} on rank {rank}")
            # every rank goes through backward (its gradients take part in the allreduce); with
            # skip_step, non-finite *reduced* gradients, the same on every rank, skip the update
            scaled = (loss * weight if weight != 1.0 else loss) / cfg.backward_passes_per_step
            with recorder.span("backward"):
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            if (i + 1) % cfg.backward_passes_per_step == 0:
                with recorder.span("optimizer step (after the gradient exchange)"):
                    skipped += self._update(epoch, i)
            clock.lap("compute")
            clock.exchanged(self._blocked_s() - blocked)
            if recorder.on:
                recorder.add(f"step {i}", step_began, recorder.now(), epoch=epoch)
            if self.first_step_s is None:  # compiling happens here: timed apart from the steps
                self.first_step_s = time.monotonic() - started
            if finite:
                sums += figures
            self._ask_driver()
            self._checkpoint_inside(epoch, i, sums)
            if rank == 0 and time.monotonic() - last_report > 0.25:
                last_report = time.monotonic()
                report(to_payload(StepDone(epoch=epoch, step=i + 1, steps=self.steps,
                                           loss=float(sums[0] / sums[1]))))
        logs = self._epoch_logs(epoch, sums, skipped)
        if first:
            logs["resumed_at_step"] = first  # this epoch went on from a checkpoint inside it
        return logs

    def _batches(self, epoch: int, first: int) -> Iterator[Dict[str, Any]]:
        cfg = self.cfg
        if cfg.elastic is None:
            return _run_batches(cfg, "train", cfg.batch_size, self.rank, self.size, epoch, self.steps, cfg.shuffle,
                                True, self.workers, self.device)
        batches = cfg.dataset.global_batches(cfg.elastic.global_batch, self.rank, self.size, seed=cfg.seed,
                                             epoch=epoch, start_step=first, steps=self.steps - first,
                                             shuffle=cfg.shuffle, transform=cfg.transform_fn)
        return pinned(batches) if self.device.type == "cuda" else batches

    def _ask_driver(self) -> None:
        """After each step of an elastic fit: what the driver asks, the same on every rank (rank 0
        reads the request at most twice a second; a one-integer broadcast carries it)."""
        if self.stop_request is None:
            return
        seen = 0
        if self.rank == 0 and time.monotonic() >= self.next_look:
            self.next_look = time.monotonic() + 0.5
            seen = self.stop_request.read()
        agreed = int(sr.broadcast_(torch.tensor([seen], dtype=torch.int64), root_rank=0, name="sparkring.stop")[0])
        self.asked = max(self.asked, agreed)

    def _checkpoint_inside(self, epoch: int, i: int, sums: torch.Tensor) -> None:
        """Every checkpointEvery steps, and at once when the driver asks to LEAVE (not at the
        epoch's end, which has its own): the trainer with the position and every rank's figures
        so far; then every rank stops if the driver asked it to."""
        every = self.cfg.elastic.checkpoint_every if self.cfg.elastic is not None else None
        due = bool(every) and (i + 1) % every == 0
        if not (due or self.asked == LEAVE) or i + 1 >= self.steps:
            return
        totals = sr.allreduce(sums.cpu(), op=sr.Sum).tolist()
        if self.checkpointer is not None:  # every rank writes its shards
            with recorder.span("checkpoint (inside the epoch, this rank's shards)", step=i + 1):
                self.checkpointer.save(epoch, self.model, self.opt,
                                       self._trainer_state(epoch, False, position=(i + 1, totals)), step=i + 1)
        elif self.rank == 0:
            with recorder.span("checkpoint (inside the epoch)", step=i + 1):
                _save_checkpoint(self.cfg, self.model, self.opt,
                                 self._trainer_state(epoch, False, position=(i + 1, totals)))
        if self.asked:
            raise _Paused()

    def _epoch_logs(self, epoch: int, sums: torch.Tensor, skipped: int) -> Dict[str, Any]:
        cfg = self.cfg
        totals = sr.allreduce(sums.cpu(), op=sr.Sum)
        logs: Dict[str, Any] = {"epoch": epoch, "loss": float(totals[0] / totals[1])}
        for j, name in enumerate(cfg.log_names()):
            logs[name] = float(totals[2 + j] / totals[1])
        if cfg.skip_non_finite or cfg.precision == "16-mixed":
            logs["skipped_steps"] = skipped
        if cfg.compile is not None and epoch == self.start_epoch:
            logs["first_step_seconds"] = self.first_step_s
        if cfg.elastic is not None:
            logs.update(num_proc=self.size, restarts=cfg.elastic.restarts, grows=cfg.elastic.grows,
                        decommissions=cfg.elastic.decommissions)
        logs.update(self._time_split(float(totals[1])))
        if cfg.lightning:
            self.model.on_train_epoch_end()
            logs.update(self.step.logged["train"].epoch_means())
        if self.val_steps:
            with recorder.span("validation"):
                logs.update(_validate(cfg, self.step, self.runs, self.rank, self.size, epoch, self.val_steps,
                                      self.workers))
        for schedule in self.schedules:
            if schedule.interval == "epoch" and (epoch + 1) % schedule.frequency == 0:
                schedule.step(logs)
        return logs

    def end_epoch(self, epoch: int, logs: Dict[str, Any]) -> bool:
        """Rank 0's callbacks, history, early stopping and checkpoint; whether every rank stops."""
        stop = False
        if self.rank == 0:
            self.callbacks.call("on_epoch_end", epoch, logs, self.model)
            stop = bool(logs.pop("stop_training", False))
            self.history.append(dict(logs))
            assert self.board is not None
            self.board.epoch(epoch, logs)
            stop = self._early_stop(logs) or stop
            if not self.sharded:
                with recorder.span("checkpoint"):
                    _save_checkpoint(self.cfg, self.model, self.opt, self._trainer_state(epoch, stop))
        stop = bool(sr.broadcast_object(stop, root_rank=0))
        if self.checkpointer is not None:  # every rank writes its shards
            with recorder.span("checkpoint (this rank's shards)"):
                self.checkpointer.save(epoch, self.model, self.opt, self._trainer_state(epoch, stop))
        if self.rank == 0:
            report(to_payload(EpochDone(epoch=epoch, logs=logs, stopped=stop)))
        if self.asked and not stop and epoch + 1 < self.cfg.epochs:
            raise _Paused()
        return stop

    def _scaled_update(self) -> int:
        """16-mixed: unscale the reduced gradients, step unless they overflowed; the reduced
        gradients are the same on every rank, so is the decision. 1 where the step was skipped."""
        opt, scaler = self.opt, self.scaler
        assert scaler is not None
        opt.synchronize()
        scaler.unscale_(opt)
        before = scaler.get_scale()
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        return int(scaler.get_scale() < before)

    def _time_split(self, rows: float) -> Dict[str, float]:
        """Seconds of the epoch's training steps by part, this rank's (rank 0 reports it) and the
        slowest rank's; samples/s over every rank's rows; the training state of the rank that
        keeps the most (one exchange for all of it)."""
        mine = self.clock.seconds()
        largest = sr.allreduce(torch.tensor(mine + list(self.state_sizes), dtype=torch.float64), op=sr.Max).tolist()
        split = {}
        for j, part in enumerate(("data", "compute", "comm", "other")):
            split[f"time_{part}"] = mine[j]
            split[f"time_{part}_slowest"] = largest[j]
        split["samples_per_second"] = rows / mine[4] if mine[4] > 0 else 0.0
        split["state_bytes"], split["grad_bytes"] = int(largest[5]), int(largest[6])
        return split

    def _trainer_state(self, epoch: int, stopped: bool,
                       position: Optional[Tuple[int, List[float]]] = None) -> Dict[str, Any]:
        """The trainer's part of a checkpoint, sharded or not (after ``epoch``, or inside it at
        ``position``: the next step and every rank's figures so far)."""
        # a snapshot: an asynchronous checkpoint is completed after later epochs have run
        return {"epoch": epoch, "history": [dict(h) for h in self.history], "seed": self.cfg.seed, "stopped": stopped,
                "early_stopping": (self.best, self.waited),
                "schedulers": [s.scheduler.state_dict() for s in self.schedules],
                "step": position[0] if position else None, "epoch_sums": position[1] if position else None}

    def _restore_trainer(self, state: Dict[str, Any]) -> None:
        self.history = list(state["history"])
        self.start_epoch = int(state["epoch"]) + 1
        if state.get("step") is not None:  # saved inside the epoch: go on at its next step
            self.start_epoch, self.start_step = int(state["epoch"]), int(state["step"])
            self.epoch_sums = list(state["epoch_sums"])
        self.stopped = bool(state.get("stopped"))
        self.best, self.waited = state.get("early_stopping", (None, 0))
        for schedule, saved in zip(self.schedules, state.get("schedulers", [])):
            schedule.scheduler.load_state_dict(saved)

    def _early_stop(self, logs: Dict[str, Any]) -> bool:
        es = self.cfg.early_stopping
        if es is None:
            return False
        value = logs.get(es.monitor)
        if value is None:
            raise ValueError(f"earlyStopping monitors {es.monitor!r} but the epoch logs have "
                             f"{sorted(logs)}; monitor one of those")
        better = self.best is None or (value < self.best - es.min_delta if es.mode == "min"
                                       else value > self.best + es.min_delta)
        if better:
            self.best, self.waited = value, 0
            return False
        self.waited += 1
        return self.waited >= es.patience

    def pause(self) -> Optional[RankResult]:
        """Stop at the checkpoint just written (the driver launches more ranks from it)."""
        if self.checkpointer is not None:
            self.checkpointer.finish()
        recorder.stop()
        if self.board is not None:
            self.board.close()
        return RankResult(state_dict={}, history=self.history, output_shapes=None, paused=True) if self.rank == 0 \
            else None

    def finish(self) -> Optional[RankResult]:
        if self.cfg.lightning:
            self.model.on_fit_end()
        gathered = None
        if self.checkpointer is not None:  # every rank takes part
            self.checkpointer.finish()
            gathered = sharding.full_state_dict(self.model)
        timeline = sr.allgather_object(recorder.events()) if self.cfg.timeline else None  # every rank's spans
        recorder.stop()
        if self.rank != 0:
            return None
        self.callbacks.call("on_train_end", self.history, self.model)
        if self.board is not None:
            self.board.close()
        state = gathered if gathered is not None else {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        buf = io.BytesIO()
        torch.save(state, buf)
        self.cfg.store.write_bytes(self.cfg.store.model_path(self.cfg.run_id, "state_dict.pt"), buf.getvalue())
        return RankResult(state_dict=state, history=self.history, output_shapes=self.step.output_shapes,
                          timeline=timeline)


def _validate(cfg: TrainConfig, step: Any, model, rank: int, size: int, epoch: int, val_steps: int,
              workers: int) -> Dict[str, float]:
    model.eval()
    if cfg.lightning:
        model.on_validation_epoch_start()
    sums = torch.zeros(step.width(), dtype=torch.float64, device=step.device)
    with torch.no_grad():
        for i, batch in enumerate(_run_batches(cfg, "val", cfg.val_batch_size, rank, size, epoch, val_steps, False,
                                               False, workers, step.device)):
            sums += step.figures(*step(model, batch, f"epoch {epoch}, validation batch {i}"))
    totals = sr.allreduce(sums.cpu(), op=sr.Sum)
    if cfg.lightning:
        model.on_validation_epoch_end()
        logged = step.logged["val"].epoch_means()
        if totals[1] == 0 or not step.validation_returns_loss:
            return logged  # validation_step logs its figures itself (self.log)
        return {"val_loss": float(totals[0] / totals[1]), **logged}
    if totals[1] == 0:
        return {}
    logs = {"val_loss": float(totals[0] / totals[1])}
    for j, name in enumerate(cfg.log_names()):
        logs[f"val_{name}"] = float(totals[2 + j] / totals[1])
    return logs
