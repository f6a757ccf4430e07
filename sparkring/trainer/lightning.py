"""A LightningModule inside the trainer's loop: batches as ``(inputs..., label)``,
its training/validation/predict steps, configure_optimizers' optimizer and LR schedulers, its
epoch hooks, and what it records with ``self.log`` (averaged over the epoch and the ranks).

Lightning's own loop needs a Trainer, which would bring its own data path and process
launch; the estimator keeps sparkring's (reader, DistributedOptimizer, checkpoints) and calls
the module's hooks the way Lightning's automatic optimization does, which is written here.
Not supported (refused or documented): manual optimization, several optimizers, hooks that
need ``self.trainer``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from typing_extensions import override

import sparkring.collective as sr

from .figures import Totals, figures_tensor
from .schedule import Schedule
from .step import Step, add_note

# A LightningModule, not imported (Lightning stays optional): its hooks are looked up by name
LightningModule = Any


def is_lightning_module(model: Any) -> bool:
    """Whether ``model`` is a LightningModule (pytorch_lightning or lightning.pytorch), without
    importing Lightning where the model does not come from it."""
    return any(cls.__name__ == "LightningModule" and cls.__module__.split(".")[0] in ("pytorch_lightning", "lightning")
               for cls in type(model).__mro__)


def overrides(module: LightningModule, hook: str) -> bool:
    """Whether the user's class defines ``hook`` (LightningModule's own is a placeholder)."""
    for cls in type(module).__mro__:
        if cls.__name__ == "LightningModule":
            return False
        if hook in cls.__dict__:
            return True
    return False


def check_module(module: LightningModule) -> Optional[str]:
    """What keeps this LightningModule from training in the estimator, or None."""
    if not overrides(module, "training_step"):
        return f"{type(module).__name__} defines no training_step: the estimator trains through it"
    if not overrides(module, "configure_optimizers"):
        return f"{type(module).__name__} defines no configure_optimizers: it decides the optimizer"
    if not getattr(module, "automatic_optimization", True):
        return (f"{type(module).__name__} sets automatic_optimization = False; manual optimization needs a "
                "Trainer: train it with your own Trainer inside sparkring.run (sparkring.lightning)")
    return None


def optimizers(module: LightningModule) -> Tuple[torch.optim.Optimizer, List[Schedule]]:
    """configure_optimizers() in each of the forms Lightning accepts that have one optimizer:
    an optimizer; a list/tuple of one; ``([opt], [sched...])``; a dict with ``optimizer`` and
    ``lr_scheduler`` (a scheduler or a dict with scheduler, interval, frequency, monitor)."""
    got = module.configure_optimizers()
    schedules: List[Any] = []
    opts: List[Any]
    if isinstance(got, torch.optim.Optimizer):
        opts = [got]
    elif isinstance(got, dict):
        opts = [got.get("optimizer")]
        if got.get("lr_scheduler") is not None:
            schedules = [got["lr_scheduler"]]
        if got.get("monitor") is not None and schedules and not isinstance(schedules[0], dict):
            schedules = [{"scheduler": schedules[0], "monitor": got["monitor"]}]
    elif isinstance(got, (list, tuple)) and len(got) == 2 and isinstance(got[0], (list, tuple)):
        opts, schedules = list(got[0]), list(got[1] if isinstance(got[1], (list, tuple)) else [got[1]])
    elif isinstance(got, (list, tuple)):
        opts = list(got)
    else:
        raise ValueError(f"configure_optimizers returned {type(got).__name__}; return an optimizer, or a dict "
                         "with 'optimizer' and 'lr_scheduler'")
    if len(opts) != 1 or not isinstance(opts[0], torch.optim.Optimizer):
        raise ValueError(f"configure_optimizers returned {len(opts)} optimizers; the estimator trains with one "
                         "(several need manual optimization: use your own Trainer inside sparkring.run)")
    return opts[0], [_schedule(s) for s in schedules]


def _schedule(entry: Any) -> Schedule:
    if isinstance(entry, dict):
        interval = entry.get("interval", "epoch")
        if interval not in ("epoch", "step"):
            raise ValueError(f"lr_scheduler interval={interval!r}: use 'epoch' or 'step'")
        return Schedule(entry["scheduler"], interval, int(entry.get("frequency", 1)), entry.get("monitor"))
    return Schedule(entry)


class LoggedValues:
    """What ``self.log``/``self.log_dict`` record during a split ("train" or "val"), as row-weighted
    sums, so that the epoch's value is the mean over its rows on every rank (Lightning's
    on_epoch=True reduction; values logged outside a step weigh 1)."""

    def __init__(self):
        self.rows = 1
        self.sums: Dict[str, Tuple[float, float]] = {}

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """What LightningModule.log records: the value (a tensor's mean) under ``name``."""
        if isinstance(value, torch.Tensor):
            value = value.detach().float().mean().item()
        elif not isinstance(value, (int, float)):
            return  # Lightning logs numbers and tensors; anything else has no epoch mean
        weight = float(kwargs.get("batch_size") or self.rows)
        total, count = self.sums.get(name, (0.0, 0.0))
        self.sums[name] = (total + float(value) * weight, count + weight)

    def log_dict(self, values: Dict[str, Any], *args: Any, **kwargs: Any) -> None:
        """log() each of ``values``."""
        for name, value in values.items():
            self.log(name, value, **kwargs)

    def epoch_means(self) -> Dict[str, float]:
        """Means over this epoch's rows on every rank (a collective call: every rank makes it)."""
        gathered = sr.allgather_object(self.sums)
        self.sums = {}
        names = sorted({name for part in gathered for name in part})
        means = {}
        for name in names:
            total = sum(part[name][0] for part in gathered if name in part)
            count = sum(part[name][1] for part in gathered if name in part)
            means[name] = total / count
        return means


class LightningStep(Step):
    """The estimator's step for a LightningModule: trainer.step's Step protocol (the loss of a
    batch, the figures to average, the hooks around epochs), through its own steps and hooks.

    >>> step = LightningStep(labels=("label",), spec=spec, device=torch.device("cpu"), rank=0)  # doctest: +SKIP
    """

    def __init__(self, labels, spec, device: torch.device, rank: int, batch_form: str = "tuple"):
        self.labels, self.spec, self.rank, self.batch_form = labels, spec, rank, batch_form
        self.device: torch.device = device
        self.output_shapes: Optional[List[List[int]]] = None  # transform measures predict_step's
        self.logged = {"train": LoggedValues(), "val": LoggedValues()}
        self.batch_index = 0
        self.validation_returns_loss = False

    def attach(self, module: LightningModule) -> None:
        """Route the module's self.log/self.log_dict here (on this rank's copy only)."""
        module.log = lambda *a, **k: self._current(module).log(*a, **k)
        module.log_dict = lambda *a, **k: self._current(module).log_dict(*a, **k)

    def _current(self, module: LightningModule) -> LoggedValues:
        return self.logged["train" if module.training else "val"]

    @override
    def width(self) -> int:
        return 2

    @override
    def __call__(self, module, batch: Dict[str, Any], where: str):
        given, ys = module_batch(self.spec, self.labels, batch, self.batch_form, self.device)
        n = len(ys[0])
        self.logged["train" if module.training else "val"].rows = n
        try:
            if module.training:
                out = module.training_step(given, self.batch_index)
            else:
                out = module.validation_step(given, self.batch_index)
        except Exception as exc:
            add_note(exc, f"sparkring: on rank {self.rank}, {where}")
            raise
        self.batch_index += 1
        loss: Any = out.get("loss") if isinstance(out, dict) else out
        if module.training and not isinstance(loss, torch.Tensor):
            raise ValueError(f"training_step returned {type(out).__name__}; return the loss tensor (or a dict with "
                             "'loss'): the estimator does not skip batches")
        if not module.training:
            self.validation_returns_loss = isinstance(loss, torch.Tensor)
            loss = loss if isinstance(loss, torch.Tensor) else torch.zeros((), device=self.device)
        return loss, [loss.new_zeros((n,))], ys, [loss]

    @override
    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @override
    def figures(self, total, heads, ys, head_losses) -> torch.Tensor:
        n = heads[0].shape[0]
        with torch.no_grad():
            return figures_tensor(total.detach().to(self.device, torch.float64).reshape(()) * n,
                                  torch.tensor(float(n), dtype=torch.float64, device=self.device), [])

    @override
    def optimizer(self, module: LightningModule, given: Any) -> Tuple[torch.optim.Optimizer, List[Schedule]]:
        return optimizers(module)  # configure_optimizers decides (the optimizer Param is not used)

    @override
    def fit_began(self, module: LightningModule) -> None:
        self.attach(module)
        module.on_fit_start()

    @override
    def train_epoch_began(self, module: LightningModule) -> None:
        module.on_train_epoch_start()

    @override
    def train_epoch_ended(self, module: LightningModule) -> Dict[str, float]:
        module.on_train_epoch_end()
        return self.logged["train"].epoch_means()

    @override
    def validation_began(self, module: LightningModule) -> None:
        module.on_validation_epoch_start()

    @override
    def validation_ended(self, module: LightningModule, totals: Totals) -> Dict[str, float]:
        module.on_validation_epoch_end()
        logged = self.logged["val"].epoch_means()
        if totals.rows == 0 or not self.validation_returns_loss:
            return logged  # validation_step logs its figures itself (self.log)
        return {"val_loss": totals.loss, **logged}

    @override
    def fit_ended(self, module: LightningModule) -> None:
        module.on_fit_end()


def module_batch(spec, labels, batch: Dict[str, Any], form: str,
                 device: torch.device) -> Tuple[Any, List[torch.Tensor]]:
    """What a LightningModule's steps get from one of the reader's batches, and its labels:
    ``(inputs..., labels...)`` (form "tuple"), or Horovod's ``{column: tensor}`` (form "dict": each
    input under its column, or its name where it joins several columns or is a keyword argument).

    >>> given, ys = module_batch(spec, ("y",), batch, "dict", torch.device("cpu"))  # doctest: +SKIP
    """
    args, kwargs = spec.model_args(batch)
    ys = [label_tensor(batch[label]).to(device, non_blocking=True) for label in labels]
    if form == "dict":
        named = dict(zip([i.columns[0] if len(i.columns) == 1 else i.name for i in spec.inputs], args))
        named.update(kwargs)
        named.update(zip(labels, ys))
        return {k: v.to(device, non_blocking=True) for k, v in named.items()}, ys
    inputs = [a.to(device, non_blocking=True) for a in args]
    if kwargs:
        inputs = [{k: v.to(device, non_blocking=True) for k, v in kwargs.items()}]
    return (*inputs, *ys), ys


def label_tensor(values: Any) -> torch.Tensor:
    """A label column as a tensor: integral values as int64 (class indices for cross_entropy),
    others as float32, as a Lightning user's DataLoader usually gives them."""
    y = torch.as_tensor(values)
    if y.dtype.is_floating_point:
        return y.float()
    return y.long() if y.dtype != torch.bool else y.float()


def inference_call(module: LightningModule) -> Callable[..., Any]:
    """What transform() calls: predict_step(batch, batch_idx) where the module defines one
    (batch: the input, or a tuple of inputs), else forward()."""
    if not (is_lightning_module(module) and overrides(module, "predict_step")):
        return module

    def predict(*args: Any, **kwargs: Any) -> Any:
        batch: Any = kwargs if kwargs else (args[0] if len(args) == 1 else tuple(args))
        return module.predict_step(batch, 0)

    return predict
