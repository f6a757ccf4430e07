"""A trial's epoch gate, between its rank 0 and the tuner on the driver: rank 0 writes each
epoch's metric, the tuner answers whether the trial goes on (Optuna's pruner decides there), and
every rank of the trial stops at that epoch's end when it is pruned.

Files in the trial's run directory of the Store, because the Store is what both sides reach on
any cluster (a local path, HDFS, an object store, Spark Connect's detached runs), as the elastic
fit's StopRequest; the rank side imports nothing of the driver's."""
from __future__ import annotations

import json
import math
import posixpath
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

GO_ON, PRUNE = "go on", "prune"


@dataclass
class EpochGate:
    """A callback (the estimator's ``callbacks`` Param) that reports ``metric`` at each epoch's end
    under ``url`` and waits up to ``wait_s`` for the tuner's verdict; a pruned trial's last epoch
    says ``pruned: 1.0`` and the fit stops there (every rank at once, as early stopping does).

    >>> import tempfile
    >>> gate = EpochGate(tempfile.mkdtemp(), "val_loss", wait_s=0.1)
    >>> logs = {"val_loss": 0.5}
    >>> gate.on_epoch_end(0, logs, None); "pruned" in logs  # no verdict came within wait_s: go on
    False
    """

    url: str
    metric: str
    storage_options: Dict[str, Any] = field(default_factory=dict)
    wait_s: float = 600.0

    def _fs(self):
        import fsspec

        return fsspec.core.url_to_fs(self.url, **self.storage_options)

    def on_epoch_end(self, epoch: int, logs: Dict[str, Any], model: Any = None) -> None:
        """Report the epoch's metric to the trial; stop the fit where Optuna prunes it."""
        value = logs.get(self.metric)
        if value is None:
            raise ValueError(f"the Tuner's metric {self.metric!r} is not among the epoch's figures {sorted(logs)}: "
                             "pass one of those as metric= (val_* figures need validation > 0)")
        fs, root = self._fs()
        fs.makedirs(root, exist_ok=True)
        with fs.open(posixpath.join(root, f"epoch-{epoch:05d}.json"), "w") as f:
            json.dump({"epoch": epoch, "value": float(value)}, f)
        if wait_verdict(fs, root, epoch, self.wait_s) == PRUNE:
            logs["pruned"] = 1.0
            logs["stop_training"] = True


def wait_verdict(fs: Any, root: str, epoch: int, wait_s: float) -> str:
    """The tuner's verdict on ``epoch`` (GO_ON where none came within ``wait_s``)."""
    path, deadline, pause = posixpath.join(root, f"verdict-{epoch:05d}"), time.monotonic() + wait_s, 0.01
    while True:
        try:
            with fs.open(path, "r") as f:
                return f.read().strip()
        except (FileNotFoundError, OSError):
            if time.monotonic() >= deadline:
                return GO_ON
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def read_report(fs: Any, root: str, epoch: int) -> Optional[float]:
    """The metric rank 0 reported for ``epoch``, or None while it has not (NaN for a non-finite one).

    >>> import fsspec, tempfile
    >>> read_report(fsspec.filesystem("file"), tempfile.mkdtemp(), 0) is None
    True
    """
    try:
        with fs.open(posixpath.join(root, f"epoch-{epoch:05d}.json"), "r") as f:
            value = json.load(f)["value"]
    except (FileNotFoundError, OSError, ValueError):
        return None
    return float(value) if value is not None and math.isfinite(float(value)) else math.nan


def give_verdict(fs: Any, root: str, epoch: int, verdict: str) -> None:
    """The tuner's answer to ``epoch``'s report."""
    with fs.open(posixpath.join(root, f"verdict-{epoch:05d}"), "w") as f:
        f.write(verdict)
