"""Rank 0's hooks at the ends of epochs: the user's callbacks, TensorBoard, early stopping."""
from __future__ import annotations

from typing import Any, Dict, Optional

from .config import EarlyStopping, TrainConfig


class Callbacks:
    """The callbacks Param: objects with on_train_begin/on_epoch_end/on_train_end, or plain
    callables of (epoch, logs) called at each epoch's end.

    >>> Callbacks([lambda epoch, logs: print(epoch, logs)]).call("on_epoch_end", 0, {"loss": 1.0}, None)
    0 {'loss': 1.0}
    """

    def __init__(self, callbacks):
        self.callbacks = list(callbacks or [])

    def call(self, hook: str, *args):
        """Call ``hook`` on every callback that has it."""
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(*args)
            elif hook == "on_epoch_end" and callable(cb):
                cb(*args[:2])


class Tensorboard:
    """Each epoch's figures as TensorBoard scalars, where the Store is local and tensorboard installs."""

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
        """Write an epoch's numeric figures."""
        if self.writer is not None:
            for k, v in logs.items():
                if isinstance(v, (int, float)) and k != "epoch":
                    self.writer.add_scalar(k, v, epoch)
            self.writer.flush()

    def close(self):
        """Close the writer."""
        if self.writer is not None:
            self.writer.close()


class EarlyStopper:
    """Whether an epoch ends the fit: ``monitor`` has not improved by ``min_delta`` for
    ``patience`` epochs.

    >>> stopper = EarlyStopper(EarlyStopping(monitor="val_loss", patience=1))
    >>> [stopper.stop({"val_loss": v}) for v in (1.0, 0.5, 0.6)]
    [False, False, True]
    """

    def __init__(self, rule: Optional[EarlyStopping]):
        self.rule = rule
        self.best: Optional[float] = None
        self.waited = 0

    def stop(self, logs: Dict[str, Any]) -> bool:
        """Whether the early-stopping rule ends the fit after an epoch with these ``logs``."""
        es = self.rule
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
