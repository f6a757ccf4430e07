"""Implicit-feedback recommender on planted latent factors (synthetic, seeded, offline):
user and item ids go to nn.Embedding (sparse gradients) as int64 inputs beside a dense
column; held-out AUC against an item-popularity baseline.

    python examples/recommender.py            # 2,000 users x 500 items, local[2]
    python examples/recommender.py --fast     # a smaller run (the test suite's)
"""
import argparse
import os
import sys
import tempfile

import numpy as np
import torch
from pyspark.sql import SparkSession
from sklearn.metrics import roc_auc_score

from sparkring import SparkRingEstimator, Store

parser = argparse.ArgumentParser()
parser.add_argument("--fast", action="store_true", help="fewer rows and epochs")
args = parser.parse_args()
USERS, ITEMS, DIM = 2000, 500, 8
ROWS, EPOCHS = (200_000, 5) if args.fast else (400_000, 6)

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
builder = SparkSession.builder.appName("sparkring recommender")
if "spark.master" not in SparkSession.builder._options and not os.environ.get("SPARK_ENV_LOADED"):
    builder = builder.master("local[2]")
spark = (builder.config("spark.driver.host", os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"))
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")

# Planted taste: P(click) = sigmoid(<u, v> + popularity + 0.5 * activity)
rng = np.random.default_rng(0)
u = rng.normal(0, 1.0, size=(USERS, DIM))
v = rng.normal(0, 1.0, size=(ITEMS, DIM))
popularity = rng.normal(0, 1.0, size=ITEMS)
user = rng.integers(0, USERS, size=ROWS)
item = rng.integers(0, ITEMS, size=ROWS)
activity = rng.normal(size=ROWS)
logit = (u[user] * v[item]).sum(1) / np.sqrt(DIM) * 2 + popularity[item] + 0.5 * activity
clicked = (rng.uniform(size=ROWS) < 1 / (1 + np.exp(-logit))).astype(float)
df = spark.createDataFrame(
    [(int(a), int(b), float(c), float(d)) for a, b, c, d in zip(user, item, activity, clicked)],
    "user int, item int, activity double, clicked double")
train, test = df.randomSplit([0.8, 0.2], seed=1)


class MatrixFactorization(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.user = torch.nn.Embedding(USERS, DIM, sparse=True)
        self.item = torch.nn.Embedding(ITEMS, DIM, sparse=True)
        self.item_bias = torch.nn.Embedding(ITEMS, 1, sparse=True)
        self.dense = torch.nn.Linear(1, 1)
        for emb in (self.user, self.item):
            torch.nn.init.normal_(emb.weight, std=0.1)
        torch.nn.init.zeros_(self.item_bias.weight)

    def forward(self, user, item, activity):  # int64 ids (batch,), float32 (batch, 1)
        dot = (self.user(user) * self.item(item)).sum(1, keepdim=True)
        return dot + self.item_bias(item) + self.dense(activity)


torch.manual_seed(0)
est = SparkRingEstimator(
    model=MatrixFactorization(), optimizer=lambda params: torch.optim.Adagrad(params, lr=0.1),
    loss="bce_with_logits", modelInputs=["user", "item", "activity"], labelCol="clicked",
    batchSize=256, epochs=EPOCHS, numProc=2, seed=0, verbose=1,
    store=Store(tempfile.mkdtemp(prefix="recommender-store-")))
model = est.fit(train)

scored = model.transform(test).select("item", "clicked", "probability").toPandas()
model_auc = roc_auc_score(scored["clicked"], [p[1] for p in scored["probability"]])
rates = train.groupBy("item").avg("clicked").toPandas().set_index("item")["avg(clicked)"]
baseline_auc = roc_auc_score(scored["clicked"], scored["item"].map(rates).fillna(rates.mean()))
print(f"held-out AUC: model {model_auc:.4f}, popularity baseline {baseline_auc:.4f}")
spark.stop()
sys.exit(0 if model_auc > baseline_auc + 0.03 else 1)
