"""Models, data and callbacks for the estimator tests (importable by Spark's workers)."""
import os
import time

import numpy as np
import torch
from pyspark.ml.linalg import Vectors


def classification_df(spark, n=480, d=8, classes=3, seed=0, partitions=3):
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 3, size=(classes, d))
    labels = rng.integers(0, classes, size=n)
    x = centers[labels] + rng.normal(0, 1, size=(n, d))
    rows = [(i, Vectors.dense(x[i]), float(labels[i])) for i in range(n)]
    return spark.createDataFrame(rows, ["id", "features", "label"]).repartition(partitions, "id")


def regression_df(spark, n=400, seed=0):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=n), rng.normal(size=n)
    rows = [(i, float(a[i]), float(b[i]), float(2 * a[i] - 3 * b[i] + 0.5)) for i in range(n)]
    return spark.createDataFrame(rows, ["id", "a", "b", "y"]).repartition(2, "id")


def mlp(d=8, classes=3, seed=0, dropout=0.2):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(16, classes))


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


class FailOnce:
    """Raises at the end of ``epoch`` the first time only (a marker file remembers)."""

    def __init__(self, marker, epoch):
        self.marker = marker
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs, model):
        if epoch == self.epoch and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            self.fail(epoch)

    def fail(self, epoch):
        raise RuntimeError(f"injected failure at epoch {epoch}")


class KillOnce(FailOnce):
    """Kills its own rank with SIGKILL (as the OOM killer would) instead of raising."""

    def fail(self, epoch):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class ForwardFails(torch.nn.Module):
    """A classifier whose forward raises: a rank failure from user code."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, x):
        raise RuntimeError("forward fails on purpose")


class KillExecutorOnce(FailOnce):
    """Kills the JVM of the executor this rank runs in (as a lost node or the OOM killer would):
    rank 0's executor dies with all its tasks and Python workers."""

    def fail(self, epoch):
        import signal

        import psutil

        for parent in psutil.Process().parents():
            if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in parent.cmdline():
                parent.send_signal(signal.SIGKILL)
                time.sleep(60)  # dies with its executor
        raise AssertionError("no executor JVM above this rank: not on a cluster session?")


class RecordEpochs:
    """Appends one line per epoch to a file: proof the callback ran, where and when."""

    def __init__(self, path, sleep=0.0):
        self.path = path
        self.sleep = sleep

    def on_train_begin(self, model):
        with open(self.path, "a") as f:
            f.write("begin\n")

    def on_epoch_end(self, epoch, logs, model):
        logs["from_callback"] = epoch * 10
        with open(self.path, "a") as f:
            f.write(f"epoch {epoch} pid {os.getpid()}\n")
        time.sleep(self.sleep)

    def on_train_end(self, history, model):
        with open(self.path, "a") as f:
            f.write(f"end {len(history)}\n")


def first_value(output, label):
    return output[:, 0].mean()


class NaNAt(torch.nn.Module):
    """An MLP whose output turns NaN on ``rank`` at the given forward calls (0-based)."""

    def __init__(self, rank, calls, d=8, classes=3):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(d, classes)
        self.rank = rank
        self.calls = set(calls)
        self.n = 0

    def forward(self, x):
        import sparkring.collective as sr

        out = self.lin(x)
        if self.training:
            if sr.rank() == self.rank and self.n in self.calls:
                out = out * float("nan")
            self.n += 1
        return out


class MatAndImage(torch.nn.Module):
    """forward(mat, img): a (4, 4) float matrix and an (8, 8, 3) uint8 image (petastorm codec fields)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.head = torch.nn.Linear(16 + 8 * 8 * 3, 1)

    def forward(self, mat, img):
        assert mat.shape[1:] == (4, 4) and img.shape[1:] == (8, 8, 3), (mat.shape, img.shape)
        return self.head(torch.cat([mat.flatten(1), img.float().flatten(1) / 255], dim=1))


class Slow(torch.nn.Module):
    """An MLP whose forward sleeps ``seconds``: epochs long enough for progress to show."""

    def __init__(self, seconds=0.03):
        super().__init__()
        self.net = mlp()
        self.seconds = seconds

    def forward(self, x):
        import time

        time.sleep(self.seconds)
        return self.net(x)


class _HugeGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by 1e30 (inf in float16)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e30


class OverflowAt(torch.nn.Module):
    """A digits MLP whose gradients overflow on ``rank`` at the given training steps (0-based
    forward calls): its loss stays finite, so a 16-mixed fit must skip exactly those updates."""

    def __init__(self, rank, calls):
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        self.rank, self.calls, self.n = rank, set(calls), 0

    def forward(self, x):
        import sparkring.collective as sr

        out = self.net(x)
        if self.training:
            if sr.rank() == self.rank and self.n in self.calls:
                out = _HugeGradient.apply(out)
            self.n += 1
        return out


def assert_pipeline_predicts_and_round_trips(fitted, df, path, column="prediction"):
    """A fitted Pipeline classifies ``df`` (accuracy > 0.85), and the PipelineModel saved at ``path``
    and loaded back gives the same ``column`` for every row."""
    from pyspark.ml import PipelineModel

    preds = fitted.transform(df)
    acc = preds.filter("prediction = label").count() / preds.count()
    assert acc > 0.85
    fitted.write().overwrite().save(str(path))
    again = PipelineModel.load(str(path))
    assert [r[column] for r in again.transform(df).orderBy("id").collect()] == \
        [r[column] for r in preds.orderBy("id").collect()]
    return preds
