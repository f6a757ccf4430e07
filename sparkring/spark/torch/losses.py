"""A Horovod TorchEstimator's loss as Horovod's remote trainer calls it: labels reshaped to the
output's shape (or to ``label_shapes``), and sample weights through ``reduction='none'``
(each row's loss times its weight, then the mean: Horovod's rule, not a weighted average).

Imports torch only: it is unpickled on the ranks."""
from __future__ import annotations

import copy
from typing import Any, Callable, List, Optional

import torch


class HorovodLoss:
    """One head's loss, called ``loss(output, label, sample_weight=None)`` by sparkring's step.

    >>> loss = HorovodLoss(torch.nn.functional.binary_cross_entropy)
    >>> loss(torch.full((2, 1), 0.5), torch.tensor([0.0, 1.0])).item()  # label (2,) reshaped to (2, 1)
    0.6931471824645996
    """

    def __init__(self, fn: Callable[..., torch.Tensor], label_shape: Optional[List[int]] = None):
        self.fn = fn
        self.label_shape = list(label_shape) if label_shape is not None else None

    def __repr__(self) -> str:
        return f"HorovodLoss({self.fn!r})"

    def _label(self, output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        if self.label_shape is not None:
            return label.reshape(self.label_shape)
        if hasattr(output, "shape") and output.shape.numel() == label.shape.numel():
            return label.reshape(output.shape)
        return label

    def __call__(self, output: torch.Tensor, label: torch.Tensor,
                 sample_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The batch's loss: the function's own reduction, or each row's loss times its weight, averaged."""
        label = self._label(output, label)
        if torch.is_tensor(output) and torch.is_floating_point(output) and torch.is_floating_point(label):
            label = label.to(output.dtype)
        if sample_weight is None:
            return self.fn(output, label)
        per_row = self._unreduced(output, label).flatten()
        return (per_row * sample_weight.to(per_row.dtype).reshape(-1)).mean()

    def _unreduced(self, output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        """The loss of every element: a torch loss module with ``reduction``, or a function taking it."""
        if isinstance(self.fn, torch.nn.Module) and hasattr(self.fn, "reduction"):
            module = copy.copy(self.fn)
            setattr(module, "reduction", "none")  # noqa: B010 - a loss module's attribute, not typed as str
            return module(output, label)
        return self.fn(output, label, reduction="none")


def horovod_losses(loss: Any, loss_constructors: Optional[List[Callable[[], Any]]], heads: int,
                   label_shapes: Optional[List[List[int]]]) -> List[HorovodLoss]:
    """The heads' losses from Horovod's ``loss`` (one, or one per label) or ``loss_constructors``;
    one loss for several labels serves each of them, as in Horovod.

    >>> [type(x).__name__ for x in horovod_losses(torch.nn.MSELoss(), None, 2, None)]
    ['HorovodLoss', 'HorovodLoss']
    """
    given = [c() for c in loss_constructors] if loss_constructors else (
        list(loss) if isinstance(loss, (list, tuple)) else [loss if loss is not None else ScoringOnly()])
    if len(given) == 1 and heads > 1:
        given = given * heads
    shapes = list(label_shapes) if label_shapes else [None] * len(given)
    return [g if isinstance(g, HorovodLoss) else HorovodLoss(g, s) for g, s in zip(given, shapes)]


class ScoringOnly:
    """The loss of a TorchModel built without one: it scores, and says so if asked to train.

    >>> ScoringOnly()(torch.zeros(1), torch.zeros(1))
    Traceback (most recent call last):
    ...
    ValueError: this TorchModel was built without a loss: it scores rows; give loss= to train it
    """

    def __call__(self, output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        """Refuse to train."""
        raise ValueError("this TorchModel was built without a loss: it scores rows; give loss= to train it")
