"""One application on the shipped environment (tests/test_standalone.py): run() where every rank
says where its sparkring comes from, then doctor(); submitted with spark-submit --archives."""
import sys

from pyspark.sql import SparkSession

import sparkring
from sparkring.runner.driver.doctor import doctor


def where_am_i():
    import sparkring
    import sparkring.collective as sr

    return f"rank {sr.rank()} of {sr.size()}: sparkring at {sparkring.__file__}"


spark = SparkSession.builder.getOrCreate()
for line in sparkring.run(where_am_i, num_proc=2, verbose=0):
    print(line, flush=True)
report = doctor(spark, timeout=120)
print(report, flush=True)
spark.stop()
sys.exit(0 if report.ok else 1)
