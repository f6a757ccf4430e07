"""An elastic fit on a standalone cluster of three one-core workers, one of which is killed for good
(the worker and its executor, never started again) at the fit's first checkpoint inside epoch 1,
beside the same fit uninterrupted: the driver process the "elastic" benchmark reads from (seconds
from the kill to the next launch's first step, and both fits' seconds from first to last step). Argument: a scratch
directory. Prints one JSON line."""
import glob
import json
import os
import sys
import tempfile
import threading
import time

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests", "helpers")]

ROWS, BATCH, RANKS, EVERY, EPOCHS = 3840, 32, 3, 10, 3  # 40 global batches an epoch


def _first_steps(audit: str):
    """Each rank process's first step time, in order."""
    return sorted(float(open(os.path.join(audit, name)).readline()) for name in os.listdir(audit))


def _training_seconds(audit: str) -> float:
    """From the first step of any rank to the last (preparing the data and starting the ranks left out)."""
    stamps = [float(t) for name in os.listdir(audit) for t in open(os.path.join(audit, name)).read().split()]
    return max(stamps) - min(stamps)


def main(scratch: str) -> None:
    import bench_fns
    import torch
    from common import standalone_session, vector_df
    from standalone_cluster import StandaloneCluster

    from sparkring import SparkRingEstimator, Store

    cluster = StandaloneCluster(tempfile.mkdtemp(dir=scratch), dict(os.environ)).start(
        ["127.0.0.2", "127.0.0.3", "127.0.0.4"], cores=1)
    try:
        spark = standalone_session(cluster.master, RANKS)
        df = vector_df(spark, ROWS).cache()
        store = Store(os.path.join(scratch, "store"))
        out = {}
        for run_id, lose in (("uninterrupted", False), ("lost", True)):
            audit = os.path.join(scratch, f"audit-{run_id}")
            os.makedirs(audit)
            done, killed = threading.Event(), []
            if lose:
                threading.Thread(target=_kill_at_checkpoint, args=(cluster, scratch, run_id, done, killed),
                                 daemon=True).start()
            began = time.time()
            fitted = SparkRingEstimator(
                model=bench_fns.CountsSteps(audit, seconds=0.1), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                loss="cross_entropy", batchSize=BATCH, epochs=EPOCHS, numProc=RANKS, minProc=2,
                checkpointEvery=EVERY, store=store, runId=run_id, verbose=0, keepData=True).fit(df)
            wall = time.time() - began
            done.set()
            firsts = _first_steps(audit)
            out[run_id] = {"wall": wall, "training": _training_seconds(audit),
                           "num_proc": [h["num_proc"] for h in fitted.history],
                           "restarts": fitted.history[-1]["restarts"]}
            if lose:
                out[run_id]["kill_to_first_step"] = firsts[RANKS] - killed[0]
        print(json.dumps(out), flush=True)
        spark.stop()
    finally:
        cluster.stop()


def _kill_at_checkpoint(cluster, scratch: str, run_id: str, done: threading.Event, killed: list) -> None:
    """Worker 2 and all it started die once the fit's first checkpoint inside epoch 1 is written."""
    pattern = os.path.join(scratch, "store", "**", run_id, "**", f"epoch-00001-step-{EVERY:07d}.pt")
    while not done.is_set() and not glob.glob(pattern, recursive=True):
        time.sleep(0.05)
    if not done.is_set():
        killed.append(time.time())
        cluster.kill_worker(2)


if __name__ == "__main__":
    main(sys.argv[1])
