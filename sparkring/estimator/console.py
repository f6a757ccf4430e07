"""The driver's console during fit(): rank 0's progress as a tqdm bar that moves (none where
stderr is not a terminal: spark-submit logs, CI), one line per epoch on stdout, and Spark's own
stage progress bar held back meanwhile so that the two do not draw over each other."""
from __future__ import annotations

import math
import sys
import threading
from typing import Any, List, Optional

from ..runner.driver.session import is_connect
from ..trainer.events import EpochDone, FitBegan, StepDone, TrainingEvent
from .text import TokenFigures

# Spark's ConsoleProgressBar draws nothing within 500 ms of its finishAll() (which also
# clears it): calling that more often than that holds it back.
_SPARK_BAR_HOLD_S = 0.3


class SparkBarPause:
    """Hold back Spark's console progress bar (a classic session with
    spark.ui.showConsoleProgress=true, as in the pyspark shell) while the block runs; it draws
    again by itself afterwards. Written by hand: Spark has no public call to pause it.

    >>> with SparkBarPause(spark):  # doctest: +SKIP
    ...     est.fit(df)
    """

    def __init__(self, spark):
        self._bar = _spark_console_bar(spark)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "SparkBarPause":
        if self._bar is not None:
            self._thread = threading.Thread(target=self._hold, name="sparkring-spark-bar", daemon=True)
            self._thread.start()
        return self

    def _hold(self) -> None:
        while True:
            try:
                self._bar.finishAll()
            except Exception:  # noqa: BLE001 - the JVM went away (session stopped): nothing to hold
                return
            if self._stop.wait(_SPARK_BAR_HOLD_S):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)


def _spark_console_bar(spark):
    """The session's ConsoleProgressBar (a JVM object), or None (Connect, or not shown)."""
    try:
        if spark is None or is_connect(spark):
            return None
        option = spark.sparkContext._jsc.sc().progressBar()
        return option.get() if option.isDefined() else None
    except Exception:  # noqa: BLE001 - an internal API of Spark's: without it there is nothing to hold
        return None


def _shows_bars() -> bool:
    """A terminal, or a notebook (whose output is no terminal but draws tqdm's widgets)."""
    if sys.stderr is not None and hasattr(sys.stderr, "isatty") and sys.stderr.isatty():
        return True
    shell = sys.modules.get("IPython")
    ipython = getattr(shell, "get_ipython", lambda: None)() if shell is not None else None
    return ipython is not None and hasattr(ipython, "kernel")


class Progress:
    """Rank 0's events as the user sees them: a tqdm bar per epoch, redrawn at every step event
    (rank 0 sends them at most every 0.25 s) and shown only on a terminal, then one line per
    epoch (kept in ``lines``).

    >>> progress = Progress(verbose=1)
    >>> progress(0, FitBegan(epochs=2, start_epoch=0, steps=4))
    >>> progress(0, EpochDone(epoch=0, logs={"epoch": 0, "loss": 0.5}))
    epoch 1/2  loss=0.5000
    >>> split = {"time_data": 0.2, "time_compute": 3.1, "time_comm": 0.9, "time_other": 0.1, "samples_per_second": 12e3}
    >>> progress(0, EpochDone(epoch=1, logs={"epoch": 1, "loss": 0.25, **split}))
    epoch 2/2  loss=0.2500  12,000 samples/s (data 0.2s, compute 3.1s, comm 0.9s, other 0.1s)
    >>> progress.close()

    A fit on a text column also shows its perplexity, tokens/s and MFU (``tokens``: how rows become tokens).
    """

    def __init__(self, verbose: int, tokens: Optional[TokenFigures] = None):
        self.verbose = verbose
        self.tokens = tokens
        self.bar: Optional[Any] = None  # tqdm's bar while an epoch runs
        self.epochs = 0
        self.lock = threading.Lock()
        self.lines: List[str] = []

    def __call__(self, rank: int, event: TrainingEvent) -> None:
        """Show rank 0's event: the bar's progress, or an epoch line."""
        if rank != 0:
            return
        with self.lock:
            if isinstance(event, FitBegan):
                self.epochs = event.epochs
                if event.start_epoch:
                    self._write(f"resuming from the checkpoint of epoch {event.start_epoch}")
            elif isinstance(event, StepDone) and self.verbose > 0:
                if self.bar is None:
                    from tqdm.auto import tqdm

                    self.bar = tqdm(total=event.steps, desc=f"epoch {event.epoch + 1}/{self.epochs}",
                                    unit="step", leave=False, file=sys.stderr, dynamic_ncols=True,
                                    disable=not _shows_bars(), mininterval=0)
                self.bar.set_postfix(loss=f"{event.loss:.4f}", refresh=False)
                self.bar.update(max(0, event.step - self.bar.n))  # draws: mininterval=0
            elif isinstance(event, EpochDone):
                self._close_bar()
                logs = event.logs
                metrics = "  ".join(f"{k}={v:.4f}" for k, v in logs.items()
                                    if k != "epoch" and not _is_timing(k) and isinstance(v, (int, float)))
                if self.tokens is not None and self.tokens.language_model:
                    metrics += f"  perplexity={math.exp(min(logs['loss'], 700.0)):.2f}"
                self._write(f"epoch {logs['epoch'] + 1}/{self.epochs}  {metrics}{_time_split(logs, self.tokens)}"
                            + ("  (early stop)" if event.stopped else ""))

    def note(self, line: str) -> None:
        """A line the driver adds between the ranks' (a restart of an elastic fit)."""
        with self.lock:
            self._close_bar()
            self._write(line)

    def _write(self, line: str) -> None:
        self.lines.append(line)
        if self.verbose > 0:
            from tqdm.auto import tqdm

            tqdm.write(line, file=sys.stdout)

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        """Close the bar (the fit ended)."""
        with self.lock:
            self._close_bar()


def _is_timing(key: str) -> bool:
    """Figures of how the epoch ran (time, throughput, memory), kept out of the metrics shown."""
    return key.startswith("time_") or key in ("samples_per_second", "state_bytes", "grad_bytes", "num_proc",
                                              "restarts", "grows", "decommissions", "resumed_at_step")


def _time_split(logs, tokens: Optional[TokenFigures] = None) -> str:
    """Where rank 0's seconds went, as the epoch line shows it (empty for logs without it); with
    ``tokens``, its tokens/s first (as history's tokens_per_second) and the MFU where it has a peak.

    >>> _time_split({"time_data": 0, "time_compute": 1, "time_comm": 0, "time_other": 0, "samples_per_second": 50},
    ...             TokenFigures(8.0, params=10, peak_flops=1e5))
    '  400 tokens/s (MFU 24.0%), 50 samples/s (compute 1.0s)'
    """
    if "time_compute" not in logs:
        return ""
    spent = [(part, _duration(logs[f"time_{part}"])) for part in ("data", "compute", "comm", "other")]
    parts = ", ".join(f"{part} {shown}" for part, shown in spent if shown)
    shown = ""
    if tokens is not None:
        rate = tokens.rate(logs["samples_per_second"])
        mfu = tokens.mfu(rate)
        shown = f"{rate:,.0f} tokens/s" + (f" (MFU {mfu:.1%})" if mfu is not None else "") + ", "
    return f"  {shown}{logs['samples_per_second']:,.0f} samples/s" + (f" ({parts})" if parts else "")


def _duration(seconds: float) -> str:
    """Seconds as an epoch line shows them: tenths of a second, milliseconds below 0.1 s, nothing
    below half a millisecond (a part that took no time is left out).

    >>> [_duration(s) for s in (3.14, 0.042, 0.0001)]
    ['3.1s', '42ms', '']
    """
    if seconds >= 0.1:
        return f"{seconds:.1f}s"
    return f"{seconds * 1000:.0f}ms" if seconds >= 0.0005 else ""
