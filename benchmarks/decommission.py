"""An elastic fit on a standalone cluster of three one-core workers, one of which is
decommissioned (SIGPWR, spark.decommission.enabled) at the fit's first checkpoint inside epoch
1, beside the same fit uninterrupted: the driver process the "elastic" benchmark reads the steps
redone from. Argument: a scratch directory. Prints one JSON line."""
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


def _steps_by_launch(audit: str, sizes):
    """Steps each launch took (counted on each of its rank processes, which all take the same)."""
    files = sorted((float(lines[0]), len(lines)) for lines in
                   (open(os.path.join(audit, name)).read().split() for name in os.listdir(audit)))
    starts = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    launches = [[steps for _, steps in files[a:b]] for a, b in zip(starts, starts[1:])]
    assert all(len(set(steps)) == 1 for steps in launches), launches
    return [steps[0] for steps in launches]


def main(scratch: str) -> None:
    import bench_fns
    import torch
    from common import standalone_session, vector_df
    from standalone_cluster import StandaloneCluster

    from sparkring import SparkRingEstimator, Store

    cluster = StandaloneCluster(tempfile.mkdtemp(dir=scratch), dict(
        os.environ, SPARK_WORKER_OPTS="-Dspark.decommission.enabled=true")).start(
        ["127.0.0.2", "127.0.0.3", "127.0.0.4"], cores=1)
    try:
        spark = standalone_session(cluster.master, RANKS, **{"spark.decommission.enabled": "true"})
        df = vector_df(spark, ROWS).cache()
        store = Store(os.path.join(scratch, "store"))
        out = {}
        for run_id, decommission in (("uninterrupted", False), ("decommissioned", True)):
            audit = os.path.join(scratch, f"audit-{run_id}")
            os.makedirs(audit)
            done = threading.Event()
            if decommission:
                threading.Thread(target=_decommission_at_checkpoint, args=(cluster, scratch, run_id, done),
                                 daemon=True).start()
            fitted = SparkRingEstimator(
                model=bench_fns.CountsSteps(audit, seconds=0.1), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                loss="cross_entropy", batchSize=BATCH, epochs=EPOCHS, numProc=RANKS, minProc=2,
                checkpointEvery=EVERY, store=store, runId=run_id, verbose=0, keepData=True).fit(df)
            done.set()
            sizes = [h["num_proc"] for h in fitted.history]
            launches = _steps_by_launch(audit, [RANKS] + ([2] if decommission else []))
            out[run_id] = {"steps": launches, "num_proc": sizes,
                           "decommissions": fitted.history[-1]["decommissions"],
                           "restarts": fitted.history[-1]["restarts"],
                           "resumed_at_step": [h.get("resumed_at_step") for h in fitted.history]}
        print(json.dumps(out), flush=True)
        spark.stop()
    finally:
        cluster.stop()


def _decommission_at_checkpoint(cluster, scratch: str, run_id: str, done: threading.Event) -> None:
    """SIGPWR to worker 1 once the fit's first checkpoint inside epoch 1 is written."""
    import glob

    pattern = os.path.join(scratch, "store", "**", run_id, "**", f"epoch-00001-step-{EVERY:07d}.pt")
    while not done.is_set() and not glob.glob(pattern, recursive=True):
        time.sleep(0.05)
    if not done.is_set():
        cluster.decommission_worker(1)


if __name__ == "__main__":
    main(sys.argv[1])
