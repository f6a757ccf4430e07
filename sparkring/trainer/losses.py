"""Named losses and how each one wants its labels and turns outputs into predictions."""
from __future__ import annotations

import inspect
from typing import Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F

# name -> (loss fn(out, y, reduction), label kind): "none" gives per-sample values, "mean" the batch's
LOSSES: Dict[str, Tuple[Callable, str]] = {
    "cross_entropy": (lambda out, y, reduction: F.cross_entropy(out, y, reduction=reduction), "class"),
    "nll": (lambda out, y, reduction: F.nll_loss(out, y, reduction=reduction), "class"),
    "mse": (lambda out, y, reduction: F.mse_loss(out, y, reduction=reduction), "regression"),
    "l1": (lambda out, y, reduction: F.l1_loss(out, y, reduction=reduction), "regression"),
    "smooth_l1": (lambda out, y, reduction: F.smooth_l1_loss(out, y, reduction=reduction), "regression"),
    "bce_with_logits": (lambda out, y, reduction: F.binary_cross_entropy_with_logits(out, y, reduction=reduction),
                        "binary"),
}
CLASSIFICATION = ("cross_entropy", "nll", "bce_with_logits")
# next-token prediction over a row of token ids: labels are the inputs (IGNORED where padding)
CAUSAL_LM, IGNORED = "causal_lm", -100
# the masked tokens' ids at their own positions (IGNORED elsewhere): an encoder's fill-in loss
MASKED_LM = "masked_lm"
TOKEN_LOSSES = (CAUSAL_LM, MASKED_LM)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross entropy over the real tokens of a batch: position t predicts
    label t+1 (Hugging Face's shift); padding (-100) counts for nothing.

    >>> round(float(causal_lm_loss(torch.zeros(1, 3, 5), torch.tensor([[1, 2, -100]]))), 4)  # log(5)
    1.6094
    """
    shifted = logits[:, :-1, :].reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(shifted, labels[:, 1:].reshape(-1).long(), ignore_index=IGNORED)


def counted_tokens(loss: str, labels: torch.Tensor) -> torch.Tensor:
    """How many tokens of ``labels`` a token loss averages over (the real ones it predicts).

    >>> int(counted_tokens(CAUSAL_LM, torch.tensor([[1, 2, -100]])))
    1
    """
    return ((labels[:, 1:] if loss == CAUSAL_LM else labels) != IGNORED).sum()


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross entropy over the masked positions of a batch (no shift: each position
    predicts its own hidden token); every other position is IGNORED.

    >>> round(float(masked_lm_loss(torch.zeros(1, 3, 5), torch.tensor([[-100, 2, -100]]))), 4)  # log(5)
    1.6094
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1).long(),
                           ignore_index=IGNORED)


def tensor_output(out):
    """A model's output as the loss sees it: a Hugging Face ModelOutput gives its logits."""
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) and not isinstance(out, torch.Tensor) else out


def check_loss(loss) -> None:
    """A loss name this module knows, or a callable: ValueError otherwise."""
    if isinstance(loss, str):
        if loss not in LOSSES and loss not in TOKEN_LOSSES:
            raise ValueError(f"loss={loss!r} is not a known loss name; use one of {sorted(LOSSES)} "
                             "or pass a callable(output, label) -> scalar")
    elif not callable(loss):
        raise ValueError(f"loss must be a name or a callable(output, label) -> scalar, got {type(loss).__name__}")


def label_kind(loss) -> str:
    """'class' (int64 indices), 'binary' (float 0/1), 'tokens' (token ids) or 'regression' (float)."""
    if loss in TOKEN_LOSSES:
        return "tokens"
    return LOSSES[loss][1] if isinstance(loss, str) else "regression"


def prepare_label(y: torch.Tensor, out: torch.Tensor, loss, check: bool) -> torch.Tensor:
    """Cast labels as the loss wants them; with ``check``, check shapes and class ranges (the
    step checks the first batch, and every batch where a bad class index is a device-side assert;
    on the CPU the loss's own IndexError is translated by check_classes)."""
    kind = label_kind(loss)
    if kind == "tokens":
        return y.long()
    if kind == "class":
        if check and torch.is_floating_point(y) and not torch.equal(y, torch.floor(y)):
            raise ValueError("labelCol holds non-integral values but loss "
                             f"{loss!r} needs class indices 0..C-1; use a regression loss or index the labels")
        y = y.long().reshape(-1)
        if check:
            check_classes(y, out, loss)
        return y
    y = y.to(out.dtype) if torch.is_floating_point(out) else y
    if not isinstance(loss, str):
        return y  # a callable loss decides how output and label line up
    if y.shape != out.shape:
        if y.numel() == out.numel():
            y = y.reshape(out.shape)
        else:
            raise ValueError(f"model output shape {tuple(out.shape)} does not match label shape {tuple(y.shape)} "
                             f"for loss {loss!r}; make the model's last layer produce one value per label")
    return y


def takes_sample_weight(loss) -> bool:
    """Whether a callable loss takes the rows' weights itself: ``loss(output, label, sample_weight=w)``
    (it then decides how they count; a named loss takes their weighted mean).

    >>> takes_sample_weight(lambda out, y, sample_weight=None: (out - y).abs().mean())
    True
    """
    try:
        return "sample_weight" in inspect.signature(loss).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def check_classes(y: torch.Tensor, out: torch.Tensor, loss) -> None:
    """Class indices ``y`` in 0..C-1 for a model with C outputs, else a ValueError with the fix."""
    if label_kind(loss) != "class" or not y.numel():
        return
    classes = out.shape[-1] if out.dim() > 1 else 1
    low, high = (int(v) for v in torch.aminmax(y.long()))
    if low < 0 or high >= classes:
        raise ValueError(f"label value {high if high >= classes else low} is out of "
                         f"range for a model with {classes} outputs (loss {loss!r} needs labels in 0..{classes - 1}); "
                         "give the model more outputs or re-index the labels")


def per_sample_loss(loss, out: torch.Tensor, y: torch.Tensor) -> Optional[torch.Tensor]:
    """Per-sample losses of a named loss; None for a user callable (it returns a scalar)."""
    if not isinstance(loss, str) or loss in TOKEN_LOSSES:
        return None
    values = LOSSES[loss][0](out, y, "none")
    return values.reshape(values.shape[0], -1).mean(dim=1) if values.dim() > 1 else values


def compute_loss(loss, out: torch.Tensor, y: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
    """The batch's mean loss of one head (``weight``: per-row weights, for named losses)."""
    if loss in TOKEN_LOSSES:
        if weight is not None:
            raise ValueError(f"sampleWeightCol does not apply to loss {loss!r} (every real token counts once)")
        return causal_lm_loss(out, y) if loss == CAUSAL_LM else masked_lm_loss(out, y)
    if isinstance(loss, str):
        try:
            if weight is None:  # the mean of every element: the per-sample means' mean
                return LOSSES[loss][0](out, y, "mean")
            values = per_sample_loss(loss, out, y)
        except IndexError:  # a class index out of range where no check ran: said as the check says it
            check_classes(y, out, loss)
            raise
        assert values is not None
        weight = weight.to(values.dtype).reshape(-1)
        return (values * weight).sum() / weight.sum().clamp_min(1e-12)
    if weight is not None:
        if not takes_sample_weight(loss):
            raise ValueError("sampleWeightCol needs a named loss or a callable taking sample_weight=")
        result = loss(out, y, sample_weight=weight)
    else:
        result = loss(out, y)
    if not isinstance(result, torch.Tensor) or result.dim() != 0:
        raise ValueError("a loss callable must return a scalar tensor (reduce with .mean())")
    return result


def predictions(loss, out: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Spark ML style outputs: prediction (+ probability and rawPrediction for classifiers)."""
    out = out.detach().float()
    if loss == "cross_entropy":
        return {"prediction": out.argmax(dim=1).double(), "probability": torch.softmax(out, dim=1).double(),
                "rawPrediction": out.double()}
    if loss == "nll":
        return {"prediction": out.argmax(dim=1).double(), "probability": out.exp().double(),
                "rawPrediction": out.double()}
    if loss == "bce_with_logits":
        z = out.reshape(out.shape[0], -1)[:, 0]
        p = torch.sigmoid(z)
        return {"prediction": (p > 0.5).double(), "probability": torch.stack([1 - p, p], dim=1).double(),
                "rawPrediction": torch.stack([-z, z], dim=1).double()}
    flat = out.reshape(out.shape[0], -1)
    return {"prediction": flat[:, 0].double() if flat.shape[1] == 1 else flat.double()}


def metric_fns(metrics) -> Dict[str, Callable]:
    """The metrics Param as name -> callable(output, label) ("accuracy" by name)."""
    if metrics is None:
        return {}
    if isinstance(metrics, dict):
        items = list(metrics.items())
    elif callable(metrics) or isinstance(metrics, str):
        items = [(None, metrics)]
    else:
        items = [(None, m) for m in metrics]
    out: Dict[str, Callable] = {}
    for name, fn in items:
        if isinstance(fn, str):
            if fn != "accuracy":
                raise ValueError(f"metric {fn!r} is not known; use 'accuracy' or a callable(output, label) -> scalar")
            name, fn = "accuracy", accuracy
        if not callable(fn):
            raise ValueError(f"metrics must be callables(output, label) -> scalar, got {type(fn).__name__}")
        out[name or getattr(fn, "__name__", f"metric{len(out)}")] = fn
    return out


def accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Share of rows whose argmax (or logit > 0 for one output) equals the label.

    >>> accuracy(torch.tensor([[0.1, 0.9]]), torch.tensor([1]))
    tensor(1.)
    """
    if out.dim() > 1 and out.shape[1] > 1:
        pred = out.argmax(dim=1)
    else:
        pred = (out.reshape(-1) > 0).long()
    return (pred == y.reshape(-1).long()).float().mean()


LossSpec = Union[str, Callable]
