"""A user's own training step, Horovod's ``train_minibatch_fn``: the user's function runs a batch's
forward, loss, backward and optimizer step with Horovod's arguments; sparkring's loop keeps the
batches, the rate, the figures and the epochs.

Horovod's remote trainer calls ``fn(model, optimizer, transform_outputs, loss_fn, inputs, labels,
sample_weights, backward_passes_per_step, batch_idx)`` for each batch, takes ``(outputs, loss)``
back and steps the optimizer once more after each epoch (its default function steps before a
group's first batch, so an epoch's last group is applied then): so does sparkring's loop
(``Trainer.train_step``, ``Trainer.train_epoch``). The optimizer is sparkring's
DistributedOptimizer: its ``step()`` waits for the gradients' exchange, as Horovod's does.

Horovod's own function, which a user's copies and changes (it steps before a group's first batch:
a function that also steps after its last batch would have that update applied twice, here as in
Horovod):

>>> def train_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights,
...                     backward_passes_per_step, batch_idx):
...     if batch_idx % backward_passes_per_step == 0:
...         if batch_idx != 0:
...             optimizer.step()
...         optimizer.zero_grad()
...     outputs, labels = transform_outputs(model(*inputs), labels)
...     loss = loss_fn(outputs, labels, sample_weights)
...     if backward_passes_per_step > 1:
...         loss = loss / backward_passes_per_step
...     loss.backward()
...     return outputs, loss
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import losses
from .config import TrainConfig
from .step import Outcome, PlainStep, add_note

MinibatchFn = Callable[..., Tuple[Any, torch.Tensor]]


class UserMinibatch:
    """One batch through the user's ``train_minibatch_fn``; the step's outcome (the loss, the heads,
    their labels and losses) for the loop's figures.

    >>> UserMinibatch(fn, cfg, step, device, rank=0)(model, opt, batch, index=0, where="epoch 0")  # doctest: +SKIP
    """

    def __init__(self, fn: MinibatchFn, cfg: TrainConfig, step: PlainStep, device: torch.device, rank: int):
        self.fn, self.cfg, self.step, self.device, self.rank = fn, cfg, step, device, rank
        self.first = True

    def __call__(self, model: Any, optimizer: Any, batch: Dict[str, Any], *, index: int, where: str) -> Outcome:
        """Run the user's function on ``batch`` (its ``index`` in the epoch is Horovod's ``batch_idx``)."""
        cfg, device = self.cfg, self.device
        seen: Dict[str, List[torch.Tensor]] = {}
        try:
            args, _ = cfg.spec.model_args(batch)
            inputs = [a.to(device, non_blocking=True) for a in args]
            labels = [torch.as_tensor(batch[label]).to(device) for label in cfg.spec.labels]
            weights = torch.as_tensor(batch[cfg.spec.weight]).to(device) if cfg.spec.weight else None

            def transform_outputs(outputs: Any, given: List[torch.Tensor]) -> Tuple[List[Any], List[Any]]:
                heads = self.step.heads(losses.tensor_output(outputs))
                seen["heads"], seen["ys"] = heads, [
                    losses.prepare_label(label, head, loss, self.first)
                    for label, head, loss in zip(given, heads, cfg.losses)]
                return heads, seen["ys"]

            def loss_fn(outputs: List[Any], given: List[Any], sample_weights: Optional[torch.Tensor]) -> Any:
                seen["head_losses"] = [losses.compute_loss(loss, head, label, sample_weights)
                                       for loss, head, label in zip(cfg.losses, outputs, given)]
                return sum(w * value for w, value in zip(cfg.loss_weights, seen["head_losses"]))

            outputs, loss = self.fn(model, optimizer, transform_outputs, loss_fn, inputs, labels, weights,
                                    cfg.backward_passes_per_step, index)
        except Exception as exc:
            add_note(exc, f"sparkring: on rank {self.rank}, {where} (in train_minibatch_fn)")
            raise
        self.first = False
        heads = seen.get("heads") or self.step.heads(losses.tensor_output(outputs))
        ys = seen.get("ys") or labels
        head_losses = seen.get("head_losses") or [loss] * len(heads)
        if self.step.output_shapes is None:
            self.step.output_shapes = [list(h.shape[1:]) for h in heads]
        return loss.detach(), [h.detach() for h in heads], ys, [v.detach() for v in head_losses]
