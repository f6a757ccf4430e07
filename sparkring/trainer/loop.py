"""One rank's fit (what SparkRingEstimator.fit launches on every rank): the model placed, resumed
and made alike, then epochs of steps, then rank 0's result.

The loop says when; the placement (trainer.placement) and the step (trainer.step) say how."""
from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

import sparkring.collective as sr
from sparkring.collective.elastic import LEAVE
from sparkring.collective.timeline import process_started_us, recorder
from sparkring.errors import NonFiniteLossError
from sparkring.runner import report

from . import checkpoints, comm_spans, pretrained
from .activation import without_kv_cache
from .batches import pinned, run_batches
from .config import TrainConfig, default_reader_workers
from .elastic import stop_request
from .events import EpochDone, FitBegan, StepDone, to_payload
from .figures import LOSS, ROWS, TimeSplit, Totals
from .hooks import Callbacks, EarlyStopper, Tensorboard
from .lightning import LightningStep
from .link_probe import probe_links
from .measure import StepClock, state_bytes
from .minibatch import UserMinibatch
from .placement import placement_for
from .shared_rows import share_rows_on_host
from .state import TrainerState
from .step import PlainStep, Step

log = logging.getLogger(__name__)


@dataclass
class RankResult:
    """What rank 0 hands back to the driver: where the trained weights lie (a directory of the Store
    holding safetensors: they never travel through Spark), the per-epoch figures, and the output
    shape of each head (transform's columns)."""

    weights: Optional[str]
    history: List[Dict[str, Any]]
    output_shapes: Any
    paused: bool = False  # stopped at a checkpoint when the driver asked (an elastic fit resizes): no weights


class _Paused(Exception):
    """Every rank stops at the checkpoint it just wrote: the driver launches again from it."""


def train_rank(cfg: TrainConfig) -> Optional[RankResult]:
    """The training loop of one rank (what fit() runs on every rank); rank 0 returns the result.

    >>> sparkring.run(train_rank, args=(cfg,), num_proc=2)[0].history  # doctest: +SKIP
    [{'epoch': 0, 'loss': 0.52, ...}]
    """
    # with a timeline asked for, the rank's host started the recorder and sends its spans at the end
    with comm_spans.dtensor_collective_spans():
        with recorder.span("start-up: model, optimizer, resume"):
            trainer = Trainer(cfg)
        if recorder.on:
            began, _ = recorder.joined_us  # the ring was joined inside (the first collective joins it)
            recorder.add("start-up: rank process (fork or spawn, imports) until the ring", process_started_us(), began)
        probe_links()  # where the ranks span hosts: the driver names a host whose link is slow
        trainer.begin()
        try:
            for epoch in range(trainer.start_epoch, cfg.epochs):
                logs = trainer.train_epoch(epoch)
                if trainer.end_epoch(epoch, logs):
                    break
        except _Paused:
            return trainer.pause()
        return trainer.finish()


def seed_epoch(seed: int, epoch: int, rank: int) -> None:
    """Every epoch starts from RNG state derived from (seed, epoch, rank): a resumed run draws
    exactly what the uninterrupted one drew."""
    s = (seed * 1_000_003 + epoch * 7919 + rank) % (2 ** 31)
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


class Trainer:
    """One rank's fit: the model, optimizer and schedules resumed from the last checkpoint and
    made the same on every rank, then epochs of steps, then rank 0's result."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.rank, self.size = sr.rank(), sr.size()
        self.device = sr.rank_device(cfg.use_gpu)
        # a model whose values lie on storage is built empty: the placement reads this rank's share
        stored = pretrained.stored_model(cfg.model, cfg.initial_weights, cfg.store.storage_options)
        self.placement = placement_for(cfg, pretrained_model=stored is not None)
        self.model = self.placement.build(stored or cfg.model, self.device, cfg.seed)
        without_kv_cache(self.model)
        # the rows' shares: ranks holding slices of one model (a tensor-parallel group) read the same rows
        self.data_rank, self.data_size = self.placement.data_rank(), self.placement.data_size()
        self.replicas = self.size // self.data_size  # how often each row's figures are counted
        # an elastic fit's data-parallel rank trains on its share of a global batch: weighted, the mean over dp
        # is the batch's
        self.gradient_weight = (cfg.elastic.gradient_weight(self.data_rank, self.data_size) if cfg.elastic is not None
                                else 1.0)
        self.step: Step = (LightningStep(cfg.spec.labels, cfg.spec, self.device, self.rank, cfg.lightning_batch)
                           if cfg.lightning
                           else self.placement.step(cfg, self.device, self.rank))
        self.minibatch = (UserMinibatch(cfg.train_minibatch, cfg, self.step, self.device, self.rank)
                          if cfg.train_minibatch is not None and isinstance(self.step, PlainStep) else None)
        torch.manual_seed(cfg.seed)
        opt, self.schedules = self.step.optimizer(self.model, cfg.optimizer)
        self.history: List[Dict[str, Any]] = []
        self.start_epoch, self.stopped = 0, False
        self.stopper = EarlyStopper(cfg.early_stopping)
        # a checkpoint inside an epoch: the step to go on at, and the epoch's figures until then (every rank's)
        self.start_step, self.epoch_sums = 0, None  # type: Tuple[int, Optional[List[float]]]
        state = self.placement.resume(self.model, opt)
        if state is not None:
            self._restore(state)
        self.base_lrs = [g["lr"] for g in opt.param_groups]
        self.opt = self.placement.distribute(opt, self.model)
        self.steps, self.val_steps = cfg.train_steps, cfg.val_steps  # the driver decided them for every rank
        self.runs: Any = self.placement.compiled(self.model, cfg.compile)
        self.first_step_s: Optional[float] = None
        self.clock = StepClock()
        self.state_sizes = (0, 0)  # (parameters + optimizer state, gradients) in bytes, at the epoch's last update
        # float16 needs its loss scaled; bfloat16 has float32's range and does not
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.precision == "16-mixed" else None
        # a host's ranks decode each row group once between them (the segments live as long as the fit)
        self.shared_rows = share_rows_on_host(cfg.dataset, cache=True if cfg.elastic is not None else None)
        self.workers = 0
        if cfg.transform_fn is not None:
            self.workers = (cfg.reader_workers if cfg.reader_workers is not None
                            else default_reader_workers(sr.local_size()))
        self.step.fit_began(self.model)
        self.callbacks = Callbacks(cfg.callbacks if self.rank == 0 else [])
        # what the driver asks of an elastic fit (elastic.GROW, LEAVE), agreed by every rank after each step
        self.stop_request = stop_request(cfg.store, cfg.run_id) if cfg.elastic is not None else None
        self.asked, self.next_look = 0, 0.0
        self.board = Tensorboard(cfg) if self.rank == 0 else None

    def begin(self) -> None:
        """Start the fit: rank 0 reports it and calls the callbacks' on_train_begin."""
        if self.rank == 0:
            report(to_payload(FitBegan(epochs=self.cfg.epochs, start_epoch=self.start_epoch, steps=self.steps)))
            self.callbacks.call("on_train_begin", self.model)
        if self.stopped:
            self.start_epoch = self.cfg.epochs  # a resumed run that had already stopped early

    def _scale_lr(self, epoch: int, i: int) -> None:
        cfg = self.cfg
        global_step = (epoch * self.steps + i) // cfg.backward_passes_per_step
        warm = max(1.0, cfg.warmup_epochs * self.steps / cfg.backward_passes_per_step)
        size = cfg.elastic.target_size if cfg.elastic is not None else self.data_size  # the global batch's ranks
        factor = 1 + (size - 1) * min(1.0, global_step / warm) if cfg.warmup_epochs > 0 else size
        for g, lr in zip(self.opt.param_groups, self.base_lrs):
            g["lr"] = lr * factor

    def _update(self, epoch: int, i: int) -> int:
        """The optimizer step after backward_passes_per_step batches; 1 where a non-finite
        update was skipped."""
        skipped = self.placement.update(self.opt, self.model, skip_non_finite=self.cfg.skip_non_finite,
                                        scaler=self.scaler)
        if i + 1 == self.steps:  # the state is whole now (gradients and optimizer moments): measured once an epoch
            self.state_sizes = state_bytes(self.model, self.opt)
        self.opt.zero_grad()
        updates = (epoch * self.steps + i + 1) // self.cfg.backward_passes_per_step
        for schedule in self.schedules:
            if schedule.interval == "step" and updates % schedule.frequency == 0:
                schedule.step()
        return skipped

    def train_epoch(self, epoch: int) -> Dict[str, Any]:
        """One epoch of steps; its figures over every rank (and validation's)."""
        seed_epoch(self.cfg.seed, epoch, self.data_rank)
        self.model.train()
        self.step.train_epoch_began(self.model)
        first, self.start_step = self.start_step, 0  # a run resumed inside this epoch goes on at its next step
        sums = torch.zeros(self.step.width(), dtype=torch.float64, device=self.device)
        if first and self.rank == 0 and self.epoch_sums:  # every rank's figures before the checkpoint, counted once
            sums += torch.tensor(self.epoch_sums, dtype=torch.float64, device=self.device)
        skipped, last_report = 0, 0.0
        self.clock = StepClock()
        for i, batch in enumerate(self.clock.timed(self._batches(epoch, first)), start=first):
            figures, step_skipped = self.train_step(batch, epoch=epoch, index=i)
            skipped += step_skipped
            if figures is not None:
                sums += figures
            self._ask_driver()
            self._checkpoint_inside(epoch, i, sums)
            if self.rank == 0 and time.monotonic() - last_report > 0.25:
                last_report = time.monotonic()
                report(to_payload(StepDone(epoch=epoch, step=i + 1, steps=self.steps,
                                           loss=float(sums[LOSS] / sums[ROWS]))))
        if self.minibatch is not None:  # Horovod's trainer steps once more after an epoch: its last group's update
            self.opt.step()
        logs = self._epoch_logs(epoch, sums, skipped)
        if first:
            logs["resumed_at_step"] = first  # this epoch went on from a checkpoint inside it
        return logs

    def train_step(self, batch: Dict[str, Any], *, epoch: int, index: int) -> Tuple[Optional[torch.Tensor], int]:
        """One batch: the rate, forward and backward, the update after backward_passes_per_step batches,
        timed by part; (the batch's figures, None where its loss was not finite; 1 where the update was skipped)."""
        step_began = recorder.now() if recorder.on else 0.0
        if self.cfg.lr_scaling == "linear":
            self._scale_lr(epoch, index)
        started = time.monotonic() if self.first_step_s is None else 0.0
        blocked = self.placement.blocked_seconds(self.opt)
        skipped = 0
        figures: Optional[torch.Tensor]
        if self.minibatch is not None:
            figures = self.user_minibatch(self.minibatch, batch, epoch=epoch, index=index)
        else:
            figures = self.forward_backward(batch, epoch=epoch, index=index)
            if (index + 1) % self.cfg.backward_passes_per_step == 0:
                with recorder.span("optimizer step (after the gradient exchange)"):
                    skipped = self._update(epoch, index)
        self.clock.lap("compute")
        self.clock.exchanged(self.placement.blocked_seconds(self.opt) - blocked)
        if recorder.on:
            recorder.add(f"step {index}", step_began, recorder.now(), epoch=epoch)
        if self.first_step_s is None:  # compiling happens here: timed apart from the steps
            self.first_step_s = time.monotonic() - started
        return figures, skipped

    def user_minibatch(self, minibatch: UserMinibatch, batch: Dict[str, Any], *, epoch: int,
                       index: int) -> torch.Tensor:
        """One batch through the user's train_minibatch_fn (its forward, backward and update); its figures."""
        with recorder.span("train_minibatch_fn"):
            figures = self.step.figures(*minibatch(self.runs, self.opt, batch, index=index,
                                                   where=f"epoch {epoch}, training batch {index}"))
        if not math.isfinite(figures[LOSS].item()):
            raise NonFiniteLossError(f"non-finite loss {float(figures[LOSS] / figures[ROWS]):g} at epoch {epoch}, "
                                     f"step {index} on rank {self.rank}")
        return figures

    def forward_backward(self, batch: Dict[str, Any], *, epoch: int, index: int) -> Optional[torch.Tensor]:
        """Forward and backward of one batch; its figures (None where its loss was not finite and
        onNonFinite='skip_step': every rank still goes through backward, as its gradients take part
        in the exchange, and non-finite *reduced* gradients, the same on every rank, skip the update)."""
        cfg = self.cfg
        with recorder.span("forward"):
            loss, heads, ys, head_losses = self.step(self.runs, batch, f"epoch {epoch}, training batch {index}")
            figures = self.step.figures(loss, heads, ys, head_losses)
        # the one host sync of a step: whether training may go on decides the step
        finite = math.isfinite(figures[LOSS].item())
        if not finite and not cfg.skip_non_finite:
            raise NonFiniteLossError(f"non-finite loss {float(figures[LOSS] / figures[ROWS]):g} at epoch {epoch}, "
                                     f"step {index} on rank {self.rank}")
        scaled = loss * self.gradient_weight if self.gradient_weight != 1.0 else loss
        if cfg.backward_passes_per_step != 1:
            scaled = scaled / cfg.backward_passes_per_step
        with recorder.span("backward"):
            self.step.backward(self.scaler.scale(scaled) if self.scaler is not None else scaled)
        return figures if finite else None

    def _batches(self, epoch: int, first: int) -> Iterator[Dict[str, Any]]:
        cfg = self.cfg
        if cfg.elastic is None:
            return run_batches(cfg, "train", batch_size=cfg.batch_size, rank=self.data_rank, size=self.data_size,
                               epoch=epoch, steps=self.steps, shuffle=cfg.shuffle, drop_last=True,
                               workers=self.workers, device=self.device)
        batches = cfg.dataset.global_batches(cfg.elastic.global_batch, self.data_rank, self.data_size, seed=cfg.seed,
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
        due = every is not None and every > 0 and (i + 1) % every == 0
        if not (due or self.asked == LEAVE) or i + 1 >= self.steps:
            return
        totals = sr.allreduce(sums.cpu(), op=sr.Sum).tolist()
        with recorder.span("checkpoint (inside the epoch)", step=i + 1):
            self._save(self.trainer_state(epoch, stopped=False, position=(i + 1, totals)))
        if self.asked:
            raise _Paused()

    def _epoch_logs(self, epoch: int, sums: torch.Tensor, skipped: int) -> Dict[str, Any]:
        cfg = self.cfg
        totals = Totals.of(sr.allreduce(sums.cpu(), op=sr.Sum) / self.replicas)
        logs: Dict[str, Any] = {"epoch": epoch, "loss": totals.loss, **totals.means(cfg.log_names())}
        if cfg.skip_non_finite or cfg.precision == "16-mixed":
            logs["skipped_steps"] = skipped
        if cfg.compile is not None and epoch == self.start_epoch:
            logs["first_step_seconds"] = self.first_step_s
        logs["num_proc"] = self.size
        if cfg.elastic is not None:
            logs.update(**dataclasses.asdict(cfg.elastic.relaunches))
        logs.update(self._time_split(totals.rows))
        logs.update(self.step.train_epoch_ended(self.model))
        if self.val_steps:
            with recorder.span("validation"):
                logs.update(self._validate(epoch))
        for schedule in self.schedules:
            if schedule.interval == "epoch" and (epoch + 1) % schedule.frequency == 0:
                schedule.step(logs)
        return logs

    def _validate(self, epoch: int) -> Dict[str, float]:
        """Validation's figures over every rank (each runs val_steps batches of its share)."""
        cfg, step, model = self.cfg, self.step, self.runs
        model.eval()
        step.validation_began(model)
        sums = torch.zeros(step.width(), dtype=torch.float64, device=step.device)
        with torch.no_grad():
            batches = run_batches(cfg, "val", batch_size=cfg.val_batch_size, rank=self.data_rank, size=self.data_size,
                                  epoch=epoch, steps=self.val_steps, shuffle=False, drop_last=False,
                                  workers=self.workers, device=step.device)
            for i, batch in enumerate(batches):
                sums += step.figures(*step(model, batch, f"epoch {epoch}, validation batch {i}"))
        totals = Totals.of(sr.allreduce(sums.cpu(), op=sr.Sum) / self.replicas)
        return step.validation_ended(model, totals)

    def end_epoch(self, epoch: int, logs: Dict[str, Any]) -> bool:
        """Rank 0's callbacks, history, early stopping; the checkpoint; whether every rank stops."""
        stop = False
        if self.rank == 0:
            self.callbacks.call("on_epoch_end", epoch, logs, self.model)
            stop = bool(logs.pop("stop_training", False))
            self.history.append(dict(logs))
            assert self.board is not None
            self.board.epoch(epoch, logs)
            stop = self.stopper.stop(logs) or stop
        stop = bool(sr.broadcast_object(stop, root_rank=0))
        with recorder.span("checkpoint"):
            self._save(self.trainer_state(epoch, stopped=stop))
        if self.rank == 0:
            report(to_payload(EpochDone(epoch=epoch, logs=logs, stopped=stop)))
        if self.asked and not stop and epoch + 1 < self.cfg.epochs:
            raise _Paused()
        return stop

    def _time_split(self, rows: float) -> Dict[str, float]:
        """Seconds of the epoch's training steps by part, this rank's (rank 0 reports it) and the
        slowest rank's; samples/s over every rank's rows; the training state of the rank that
        keeps the most (one exchange for all of it)."""
        mine = self.clock.seconds()
        largest = sr.allreduce(torch.tensor(mine.values() + list(self.state_sizes), dtype=torch.float64),
                               op=sr.Max).tolist()
        slowest = TimeSplit.from_values(largest)
        state, grads = largest[TimeSplit.width():]
        split: Dict[str, float] = {}
        for part in TimeSplit.PARTS:
            split[f"time_{part}"] = getattr(mine, part)
            split[f"time_{part}_slowest"] = getattr(slowest, part)
        split["samples_per_second"] = rows / mine.total if mine.total > 0 else 0.0
        split["state_bytes"], split["grad_bytes"] = int(state), int(grads)
        return split

    def _save(self, state: TrainerState) -> None:
        """A checkpoint through the placement; one the Store refuses fails the fit saying where."""
        try:
            self.placement.save(self.model, self.opt, state)
        except BaseException as exc:  # DCP raises CheckpointException, a BaseException
            failed = checkpoints.unwritten(self.placement.store, self.cfg.run_id, state, exc)
            if failed is None:
                raise
            raise failed from exc

    def trainer_state(self, epoch: int, *, stopped: bool,
                      position: Optional[Tuple[int, List[float]]] = None) -> TrainerState:
        """The loop's part of a checkpoint (after ``epoch``, or inside it at ``position``: the
        next step and every rank's figures so far)."""
        # a snapshot: an asynchronous checkpoint is completed after later epochs have run
        return TrainerState(epoch=epoch, history=[dict(h) for h in self.history], seed=self.cfg.seed, stopped=stopped,
                            early_stopping=(self.stopper.best, self.stopper.waited),
                            schedulers=[s.scheduler.state_dict() for s in self.schedules],
                            step=position[0] if position else None, epoch_sums=position[1] if position else None)

    def _restore(self, state: TrainerState) -> None:
        self.history = list(state.history)
        self.start_epoch = state.epoch + 1
        if state.inside_epoch:  # saved inside the epoch: go on at its next step
            assert state.step is not None and state.epoch_sums is not None
            self.start_epoch, self.start_step = state.epoch, state.step
            self.epoch_sums = list(state.epoch_sums)
        self.stopped = state.stopped
        self.stopper.best, self.stopper.waited = state.early_stopping
        for schedule, saved in zip(self.schedules, state.schedulers):
            schedule.scheduler.load_state_dict(saved)

    def pause(self) -> Optional[RankResult]:
        """Stop at the checkpoint just written (the driver launches more ranks from it)."""
        self.placement.finish()
        if self.board is not None:
            self.board.close()
        return RankResult(weights=None, history=self.history, output_shapes=None, paused=True) if self.rank == 0 \
            else None

    def finish(self) -> Optional[RankResult]:
        """End the fit: the state gathered, rank 0's result (its weights written); None elsewhere."""
        self.step.fit_ended(self.model)
        weights = self.cfg.store.model_path(self.cfg.run_id)
        self.placement.write_fitted(self.model, self.cfg.store, weights)  # every rank takes part
        if self.rank != 0:
            return None
        self.callbacks.call("on_train_end", self.history, self.model)
        if self.board is not None:
            self.board.close()
        return RankResult(weights=weights, history=self.history, output_shapes=self.step.output_shapes)
