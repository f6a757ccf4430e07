"""Images two ways (offline): scikit-learn's digits stored as PNG bytes in a binary column,
decoded by a transformFn in reader worker processes, into a small CNN; then the same CNN
on the flat 64-float column reshaped with inputShapes.

    python examples/images.py            # local[2]
    python examples/images.py --fast     # fewer epochs (the test suite's)
"""
import argparse
import io
import os
import sys
import tempfile

import numpy as np
import torch
from PIL import Image
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits

from sparkring import SparkRingEstimator, Store

parser = argparse.ArgumentParser()
parser.add_argument("--fast", action="store_true", help="fewer epochs")
args = parser.parse_args()
EPOCHS = 10 if args.fast else 20

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
builder = SparkSession.builder.appName("sparkring images")
if "spark.master" not in SparkSession.builder._options and not os.environ.get("SPARK_ENV_LOADED"):
    builder = builder.master("local[2]")
spark = (builder.config("spark.driver.host", os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"))
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")


def png_bytes(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray((pixels * 255 / 16).astype(np.uint8).reshape(8, 8), mode="L").save(buf, format="PNG")
    return buf.getvalue()


X, y = load_digits(return_X_y=True)
df = spark.createDataFrame([(png_bytes(x), (x / 16.0).tolist(), float(t)) for x, t in zip(X, y)],
                           "image binary, pixels array<double>, label double")
train, test = df.randomSplit([0.8, 0.2], seed=7)


def decode(batch):
    """PNG bytes -> float32 pixels in [0, 1]; runs in the reader workers, and in transform()."""
    images = [np.asarray(Image.open(io.BytesIO(b)), dtype=np.float32) / 255.0 for b in batch["image"]]
    return {"image": np.stack(images)}


def cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 2 * 2, 10))


common = dict(optimizer=lambda params: torch.optim.Adam(params, lr=3e-3), loss="cross_entropy",
              labelCol="label", batchSize=32, epochs=EPOCHS, numProc=2, seed=0, verbose=1)
from_png = SparkRingEstimator(model=cnn(), modelInputs=["image"], inputShapes={"image": [1, 8, 8]},
                              transformFn=decode, readerWorkers=1,
                              store=Store(tempfile.mkdtemp(prefix="images-store-")), **common).fit(train)
png_accuracy = from_png.transform(test).filter("prediction = label").count() / test.count()
print(f"held-out accuracy, PNG bytes decoded in transformFn: {png_accuracy:.4f}")

from_floats = SparkRingEstimator(model=cnn(), featuresCol="pixels", inputShapes=[1, 8, 8],
                                 store=Store(tempfile.mkdtemp(prefix="images-store-")), **common).fit(train)
flat_accuracy = from_floats.transform(test).filter("prediction = label").count() / test.count()
print(f"held-out accuracy, flat 64-float column with inputShapes=[1, 8, 8]: {flat_accuracy:.4f}")
spark.stop()
sys.exit(0 if png_accuracy >= 0.95 and flat_accuracy >= 0.95 else 1)
