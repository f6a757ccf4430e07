"""fit() on the same data in the main environment (Spark 4) and the compat one (Spark 3.5),
alternating, each in its own interpreter: a reference so that a regression in either shows."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from common import BENCH_DIR, Row

ROOT = os.path.dirname(BENCH_DIR)
COMPAT_PYTHON = os.path.join(ROOT, ".venv-compat", "bin", "python")


def _fit(python: str, source: str, epochs: int) -> dict:
    out = subprocess.run([python, os.path.join(BENCH_DIR, "fit_once.py"), source, str(epochs)], check=True,
                         capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_versions(spark, rows, reps, tmp, n=400_000, epochs=2):
    """fit() seconds on Spark 4 (this interpreter) vs Spark 3.5 (.venv-compat), same Parquet."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    if not os.path.exists(COMPAT_PYTHON):
        print(f"skipping versions: {COMPAT_PYTHON} is missing (make test-compat creates it)")
        return
    source = os.path.join(tmp, "versions_source")
    (spark.range(n, numPartitions=4)
     .select(array_to_vector(F.array(*[F.randn(i).cast("float") for i in range(64)])).alias("features"),
             (F.rand(99) * 10).cast("int").cast("double").alias("label"))
     .write.mode("overwrite").parquet(source))
    main, compat = [], []
    for _ in range(reps):
        main.append(_fit(sys.executable, source, epochs))
        compat.append(_fit(COMPAT_PYTHON, source, epochs))
    t_main = statistics.median(r["seconds"] for r in main)
    t_compat = statistics.median(r["seconds"] for r in compat)
    m, c = main[0], compat[0]
    rows.append(Row("compat", f"fit() on Spark {m['pyspark']} (pyarrow {m['pyarrow']}) vs Spark {c['pyspark']} "
                              f"(pyarrow {c['pyarrow']}), same Parquet, {n // 1000}k rows x 64, MLP, {epochs} epochs, "
                              "2 ranks, prepare included, each in its own interpreter",
                    f"{n * epochs / t_main:,.0f} samples/s", f"Spark {c['pyspark']} {n * epochs / t_compat:,.0f} "
                    "samples/s", t_compat / t_main, "(reference)"))
