"""Train a small MLP on scikit-learn's bundled digits (offline) with 2 ranks, evaluate
on a held-out split, save/load the model and plot the loss curves.

    python examples/digits.py                      # local[2]
    spark-submit --master 'local-cluster[2,1,1024]' examples/digits.py
"""
import argparse
import os
import sys
import tempfile

import torch
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits

from sparkring import SparkRingEstimator, SparkRingModel, Store

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
args = parser.parse_args()

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
builder = SparkSession.builder.appName("sparkring digits")
if "spark.master" not in SparkSession.builder._options and not os.environ.get("SPARK_ENV_LOADED"):
    builder = builder.master("local[2]")
spark = (builder.config("spark.driver.host", os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"))
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")

X, y = load_digits(return_X_y=True)
df = spark.createDataFrame([(Vectors.dense(x / 16.0), float(t)) for x, t in zip(X, y)], ["features", "label"])
train, test = df.randomSplit([0.8, 0.2], seed=7)

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                          torch.nn.Linear(128, 10))
est = SparkRingEstimator(
    model=net, optimizer=lambda params: torch.optim.Adam(params, lr=2e-3), loss="cross_entropy",
    metrics=["accuracy"], featuresCol="features", labelCol="label", batchSize=32, epochs=args.epochs,
    numProc=2, validation=0.1, seed=0, store=Store(tempfile.mkdtemp(prefix="digits-store-")))
model = est.fit(train)

predictions = model.transform(test)
accuracy = predictions.filter("prediction = label").count() / predictions.count()
print(f"held-out accuracy: {accuracy:.4f}")

os.makedirs(args.out, exist_ok=True)
path = os.path.join(args.out, "digits-model")
model.write().overwrite().save(path)
reloaded = SparkRingModel.load(path)
same = reloaded.transform(test).select("prediction").collect() == predictions.select("prediction").collect()
print(f"reloaded model gives identical predictions: {same}")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

epochs = [h["epoch"] + 1 for h in model.history]
fig, ax = plt.subplots(figsize=(6, 4))
ax.plot(epochs, [h["loss"] for h in model.history], marker="o", label="train loss")
ax.plot(epochs, [h["val_loss"] for h in model.history], marker="o", label="validation loss")
ax.set_xlabel("epoch")
ax.set_ylabel("cross entropy")
ax.set_title(f"digits, 2 ranks — held-out accuracy {accuracy:.3f}")
ax.legend()
fig.tight_layout()
png = os.path.join(args.out, "digits_loss.png")
fig.savefig(png, dpi=100)
print(f"loss curves: {png}")
spark.stop()
sys.exit(0 if accuracy >= 0.95 and same else 1)
