"""A LightningModule on scikit-learn's bundled digits (offline), trained by SparkRingEstimator
on 2 ranks: its training_step, validation_step, configure_optimizers (with a per-epoch LR
scheduler) and self.log figures, then transform() through its predict_step.

    python examples/lightning_digits.py
"""
import argparse
import os
import sys
import tempfile

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits

from sparkring import SparkRingEstimator, Store


class DigitsClassifier(pl.LightningModule):
    def __init__(self, lr=2e-3):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(128, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("train_acc", (logits.argmax(1) == y).float().mean())
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def predict_step(self, batch, batch_idx):
        return self(batch).argmax(1)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=8, gamma=0.3)}


parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=12)
args = parser.parse_args()

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
builder = SparkSession.builder.appName("sparkring lightning digits")
if "spark.master" not in SparkSession.builder._options and not os.environ.get("SPARK_ENV_LOADED"):
    builder = builder.master("local[2]")
spark = (builder.config("spark.driver.host", os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"))
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")

X, y = load_digits(return_X_y=True)
# integer labels arrive as int64 tensors, ready for cross_entropy
df = spark.createDataFrame([(Vectors.dense(x / 16.0), int(t)) for x, t in zip(X, y)], ["features", "label"])
train, test = df.randomSplit([0.8, 0.2], seed=7)

torch.manual_seed(0)
est = SparkRingEstimator(model=DigitsClassifier(), featuresCol="features", labelCol="label", batchSize=32,
                         epochs=args.epochs, numProc=2, validation=0.1, seed=0,
                         store=Store(tempfile.mkdtemp(prefix="lightning-digits-")))
model = est.fit(train)

predictions = model.transform(test)  # predict_step: the class
accuracy = predictions.filter("prediction = label").count() / predictions.count()
print(f"held-out accuracy: {accuracy:.4f}")
spark.stop()
sys.exit(0 if accuracy >= 0.95 else 1)
