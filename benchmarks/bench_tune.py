"""Hyperparameter search side by side: the Tuner with ASHA and 2 concurrent trials against
pyspark's own sequential grid (TrainValidationSplit: CrossValidator's one-fold sibling) over the
same 16 points (4 learning rates x 4 widths) on the same DataFrame; wall time, and each search's
best model scored on the same held-out rows (log loss)."""
from __future__ import annotations

import functools
import itertools
import time

from common import Row

RATES = [0.003, 0.01, 0.03, 3.0]      # the last diverges on these overlapping classes
WIDTHS = [8, 16, 32, 64]
EPOCHS = 16


def adam_at(lr, params):
    import torch

    return torch.optim.Adam(params, lr=lr)


def mlp_of(width):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))


def _frames(spark, n=160_000, seed=0):
    import numpy as np
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, size=n)
    x = rng.normal(0, 0.7, size=(3, 8))[labels] + rng.normal(0, 1, size=(n, 8))
    rows = [(i, Vectors.dense(x[i]), float(labels[i])) for i in range(n)]
    df = spark.createDataFrame(rows, ["id", "features", "label"]).repartition(4, "id")
    train, test = df.randomSplit([0.8, 0.2], seed=1)
    return train.cache(), test.cache()


def _space(trial):
    lr, width = trial.suggest_categorical("lr", RATES), trial.suggest_categorical("width", WIDTHS)
    return {"optimizer": functools.partial(adam_at, lr), "model": functools.partial(mlp_of, width)}


def _log_loss(model, test):
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    return MulticlassClassificationEvaluator(metricName="logLoss").evaluate(model.transform(test))


def bench_tune(spark, rows, reps, tmp):
    import optuna
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit

    from sparkring import SparkRingEstimator, Store
    from sparkring.tune import Tuner

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    train, test = _frames(spark)
    est = SparkRingEstimator(model=functools.partial(mlp_of, 16), optimizer=functools.partial(adam_at, 0.01),
                             loss="cross_entropy", batchSize=64, epochs=EPOCHS, numProc=1, validation=0.25,
                             store=Store(f"{tmp}/tune"), verbose=0, seed=1)
    points = list(itertools.product(RATES, WIDTHS))
    grid = (ParamGridBuilder().addGrid(est.optimizer, [functools.partial(adam_at, lr) for lr in RATES])
            .addGrid(est.model, [functools.partial(mlp_of, w) for w in WIDTHS]).build())
    assert len(grid) == len(points) == 16
    tuner_s, grid_s, tuner_loss, grid_loss, pruned = [], [], [], [], []
    for rep in range(reps):
        began = time.monotonic()
        result = Tuner(est, _space, metric="val_loss", trials=16, concurrentTrials=2, pruner="asha",
                       sampler=optuna.samplers.GridSampler({"lr": RATES, "width": WIDTHS}, seed=rep),
                       studyName=f"bench-{rep}").fit(train)
        tuner_s.append(time.monotonic() - began)
        tuner_loss.append(_log_loss(result.best_model, test))
        pruned.append(sum(r.state == "PRUNED" for r in result.trials))
        began = time.monotonic()
        searched = TrainValidationSplit(estimator=est, estimatorParamMaps=grid, trainRatio=0.75, seed=1,
                                        evaluator=MulticlassClassificationEvaluator(metricName="logLoss")).fit(train)
        grid_s.append(time.monotonic() - began)
        grid_loss.append(_log_loss(searched.bestModel, test))
    t, g = min(tuner_s), min(grid_s)
    rows.append(Row("tune", f"16 configurations (4 rates x 4 widths, {EPOCHS} epochs, 1 rank each): Tuner with ASHA, "
                    f"2 concurrent trials ({min(pruned)}-{max(pruned)} pruned) vs TrainValidationSplit's sequential "
                    "grid (CrossValidator's one fold), wall time", f"{t:.1f} s", f"grid {g:.1f} s", g / t, ">= 3x",
                    goal_value=3.0))
    rows.append(Row("tune", "best model's log loss on the same held-out rows (lower is better): Tuner vs grid",
                    f"{min(tuner_loss):.4f}", f"grid {min(grid_loss):.4f}", min(grid_loss) / min(tuner_loss),
                    ">= 1.0x (equal or better)", goal_value=1.0))
