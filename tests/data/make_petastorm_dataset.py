"""Writes tests/data/petastorm_dataset/ with petastorm 0.12.1 (compat environment + opencv):
a dataset as a Horovod/petastorm user has it, for the main environment, where petastorm
cannot be installed, to train on. expected.npz holds what petastorm's make_reader decodes.

    .venv-compat/bin/pip install 'opencv-python-headless<4.12' -c constraints-compat.txt
    SPARK_LOCAL_IP=127.0.0.1 .venv-compat/bin/python tests/data/make_petastorm_dataset.py
"""
import os
import shutil
import sys

import numpy as np
from petastorm import make_reader
from petastorm.codecs import CompressedImageCodec, NdarrayCodec, ScalarCodec
from petastorm.etl.dataset_metadata import materialize_dataset
from petastorm.unischema import Unischema, UnischemaField, dict_to_spark_row
from pyspark.sql import SparkSession
from pyspark.sql.types import FloatType, IntegerType

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "petastorm_dataset")
ROWS = 24

Schema = Unischema("Schema", [
    UnischemaField("id", np.int32, (), ScalarCodec(IntegerType()), False),
    UnischemaField("label", np.float32, (), ScalarCodec(FloatType()), False),
    UnischemaField("mat", np.float32, (4, 4), NdarrayCodec(), False),
    UnischemaField("img", np.uint8, (8, 8, 3), CompressedImageCodec("png"), False),
    UnischemaField("thumb", np.uint8, (6, 6), CompressedImageCodec("jpeg", 95), False),
])


def main():
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.enabled", "false").getOrCreate())
    shutil.rmtree(OUT, ignore_errors=True)
    rng = np.random.default_rng(7)
    rows = []
    for i in range(ROWS):
        mat = rng.standard_normal((4, 4)).astype(np.float32)
        img = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        thumb = np.full((6, 6), 10 * (i % 20), dtype=np.uint8)
        rows.append({"id": i, "label": float(mat.sum() + img.mean() / 64), "mat": mat, "img": img, "thumb": thumb})
    url = "file://" + OUT
    with materialize_dataset(spark, url, Schema, 1):
        spark_rows = [dict_to_spark_row(Schema, r) for r in rows]
        spark.createDataFrame(spark_rows, Schema.as_spark_schema()).coalesce(2).write.parquet(url)
    spark.stop()
    for name in os.listdir(OUT):
        if name.startswith(".") or name == "_SUCCESS":
            os.remove(os.path.join(OUT, name))
    with make_reader(url, reader_pool_type="dummy", shuffle_row_groups=False) as reader:
        decoded = sorted((r._asdict() for r in reader), key=lambda r: r["id"])
    np.savez(os.path.join(HERE, "petastorm_expected.npz"),
             **{f: np.stack([r[f] for r in decoded]) for f in Schema.fields})
    print(f"wrote {OUT} ({ROWS} rows) and petastorm_expected.npz")


if __name__ == "__main__":
    main()
