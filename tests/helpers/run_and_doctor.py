"""One application on the shipped environment (tests/integration/test_standalone.py): run() where every rank
says where its sparkring comes from, then doctor(), then the script named by the arguments (with
the rest of them) in the same session; submitted with spark-submit --archives (each application
unpacks the archive on every executor again)."""
import runpy
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
if not report.ok:
    sys.exit(1)
if len(sys.argv) > 1:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")  # it stops the session
else:
    spark.stop()
