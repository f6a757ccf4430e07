"""One batch through the model: the Step protocol the loop drives, and the plain module's step
(a LightningModule's is trainer.lightning.LightningStep)."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch
from typing_extensions import override

from . import losses
from .config import OptimizerOrFactory, TrainConfig
from .figures import Totals, figures_tensor
from .schedule import Schedule

AMP_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
Outcome = Tuple[torch.Tensor, List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]  # total, heads, ys, losses


class Step(Protocol):
    """What the loop asks of a step: the batch's loss and outputs, and the figures it averages."""

    device: torch.device
    output_shapes: Optional[List[List[int]]]

    def width(self) -> int:
        """How many figures figures() returns (total loss, rows, then the logged names)."""

    def __call__(self, model: Any, batch: Dict[str, Any], where: str, /) -> Outcome:
        """Forward one batch: (total loss, each head's output, each head's label, each head's loss)."""

    def figures(self, total: torch.Tensor, heads: List[torch.Tensor], ys: List[torch.Tensor],
                head_losses: List[torch.Tensor]) -> torch.Tensor:
        """Per-batch sums over rows, float64 on the device."""

    def backward(self, loss: torch.Tensor, /) -> None:
        """Gradients of the (scaled) loss, as the step computes them."""

    def optimizer(self, model: torch.nn.Module, given: Any, /) -> Tuple[torch.optim.Optimizer, List[Schedule]]:
        """The optimizer over ``model``'s parameters (from the optimizer Param ``given``) and its LR schedules."""

    def fit_began(self, model: torch.nn.Module, /) -> None:
        """The model is placed, resumed and alike on every rank."""

    def train_epoch_began(self, model: torch.nn.Module, /) -> None:
        """An epoch's training steps start."""

    def train_epoch_ended(self, model: torch.nn.Module, /) -> Dict[str, float]:
        """An epoch's training steps ended: figures of the step's own to log (every rank calls it)."""

    def validation_began(self, model: torch.nn.Module, /) -> None:
        """Validation starts (the model is in eval mode)."""

    def validation_ended(self, model: torch.nn.Module, totals: Totals, /) -> Dict[str, float]:
        """Validation's logged figures from ``totals``, figures() summed over every batch and rank."""

    def fit_ended(self, model: torch.nn.Module, /) -> None:
        """The last epoch ended (before the fitted state is gathered)."""


def add_note(exc: BaseException, note: str) -> None:
    """Say where on which rank an exception was raised (Python 3.11's exception notes)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)


class PlainStep(Step):
    """One batch through a plain module: forward()'s arguments from the spec, one output per
    head, each head's label and loss, the weighted total, and the figures to average.

    >>> PlainStep(cfg, torch.device("cpu"), rank=0)(model, batch, "epoch 0, batch 0")  # doctest: +SKIP
    """

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

    @override
    def width(self) -> int:
        return 2 + len(self.cfg.log_names())

    @override
    def __call__(self, model: Any, batch: Dict[str, Any], where: str) -> Outcome:
        cfg, device = self.cfg, self.device
        labels = cfg.spec.labels
        try:
            args, kwargs = cfg.spec.model_args(batch)
            args = tuple(a.to(device, non_blocking=True) for a in args)
            kwargs = {k: v.to(device, non_blocking=True) for k, v in kwargs.items()}
            with self.autocast():
                out = losses.tensor_output(model(*args, **kwargs))
                heads = self.heads(out)
                check = self.first or device.type != "cpu"  # a bad class index on a GPU is a device-side assert
                ys = [losses.prepare_label(torch.as_tensor(batch[label]).to(device), head, loss, check)
                      for label, head, loss in zip(labels, heads, cfg.losses)]
                w = torch.as_tensor(batch[cfg.spec.weight]).to(device) if cfg.spec.weight else None
                head_losses = [losses.compute_loss(loss, head, y, w) for loss, head, y in zip(cfg.losses, heads, ys)]
        except Exception as exc:
            add_note(exc, f"sparkring: on rank {self.rank}, {where}")
            raise
        total = head_losses[0] if cfg.loss_weights[0] == 1.0 else head_losses[0] * cfg.loss_weights[0]
        for weight, value in zip(cfg.loss_weights[1:], head_losses[1:]):
            total = total + weight * value
        if self.output_shapes is None:
            self.output_shapes = [list(h.shape[1:]) for h in heads]
        self.first = False
        return total, heads, ys, head_losses

    def heads(self, out) -> List[torch.Tensor]:
        """The model's output as one tensor per label (labelCol's order)."""
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
        with torch.no_grad():
            means = self._means(total, heads, ys, head_losses)
            if self.device.type == "cpu":  # a CPU scalar reads without a sync: one small tensor, not a stack
                return torch.tensor([float(means[0]) * n, float(n), *(float(v) * n for v in means[1:])],
                                    dtype=torch.float64)
            rows = torch.tensor(float(n), dtype=torch.float64, device=self.device)
            sums = [torch.as_tensor(v).detach().to(self.device, torch.float64).reshape(()) * n for v in means]
            return figures_tensor(sums[0], rows, sums[1:])

    def _means(self, total, heads, ys, head_losses) -> List[Any]:
        """The batch's means in figures' order, the row count left out: the loss, then log_names()'s."""
        values: List[Any] = [total]
        if not self.cfg.multi_head:
            return values + [fn(heads[0].detach(), ys[0]) for fn in self.cfg.metrics.values()]
        for head, y, value in zip(heads, ys, head_losses):
            values.append(value)
            values += [fn(head.detach(), y) for fn in self.cfg.metrics.values()]
        return values

    @override
    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @override
    def optimizer(self, model: torch.nn.Module,
                  given: OptimizerOrFactory) -> Tuple[torch.optim.Optimizer, List[Schedule]]:
        return build_optimizer(given, model), []

    @override
    def fit_began(self, model: torch.nn.Module) -> None:
        pass

    @override
    def train_epoch_began(self, model: torch.nn.Module) -> None:
        pass

    @override
    def train_epoch_ended(self, model: torch.nn.Module) -> Dict[str, float]:
        return {}

    @override
    def validation_began(self, model: torch.nn.Module) -> None:
        pass

    @override
    def validation_ended(self, model: torch.nn.Module, totals: Totals) -> Dict[str, float]:
        if totals.rows == 0:
            return {}
        logs = {"val_loss": totals.loss}
        logs.update({f"val_{name}": value for name, value in totals.means(self.cfg.log_names()).items()})
        return logs

    @override
    def fit_ended(self, model: torch.nn.Module) -> None:
        pass


def build_optimizer(given: OptimizerOrFactory, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer Param over ``model``: an optimizer built over its parameters, or a factory's.

    >>> m = torch.nn.Linear(2, 1)
    >>> type(build_optimizer(lambda params: torch.optim.SGD(params, lr=0.1), m)).__name__
    'SGD'
    """
    if isinstance(given, torch.optim.Optimizer):
        model_params = {id(p) for p in model.parameters()}
        if any(id(p) not in model_params for g in given.param_groups for p in g["params"]):
            raise ValueError("optimizer= was built over parameters that are not the model's; build it with "
                             "model.parameters() of the same model, or pass a factory: lambda params: ...")
        return given
    opt = given(model.parameters())
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
    return opt
