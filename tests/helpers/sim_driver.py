"""A driver on the simulated hosts' head (tests/helpers/sim_hosts.py): makes a session on the
cluster, runs one scenario and prints ``RESULT <json>``. Scenarios: ``layout`` (where 4 ranks
land and their allreduce: hierarchical, flat and over MPI), ``bandwidth``
(allreduce seconds per size), ``cut`` (allreduces until a host is lost: the error and when it
came), ``fit`` (a small classifier's fitted weights), ``elastic`` (an elastic fit's weights and
history), ``sharded`` (a wider classifier's training seconds under ddp, fsdp or hsdp)."""
import json
import os
import sys
import time

HELPERS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HELPERS)

import host_fns  # noqa: E402
from sim_hosts import HEAD_ADDRESS  # noqa: E402


def session(master, cores_per_host, hosts):
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    root = os.path.dirname(os.path.dirname(HELPERS))
    if master.startswith("local"):  # the same fit on one host, for comparison; its workers import the helpers too
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HELPERS, root, os.environ.get("PYTHONPATH")) if p)
        return (SparkSession.builder.master(master).config("spark.driver.host", HEAD_ADDRESS)
                .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
    return (SparkSession.builder.master(master).appName("simulated-hosts")
            .config("spark.driver.host", HEAD_ADDRESS).config("spark.driver.bindAddress", HEAD_ADDRESS)
            .config("spark.executor.memory", "1g").config("spark.executor.cores", str(cores_per_host))
            .config("spark.cores.max", str(cores_per_host * hosts)).config("spark.ui.enabled", "false")
            .config("spark.executorEnv.PYTHONPATH", os.pathsep.join([HELPERS, root]))
            .config("spark.ui.showConsoleProgress", "false").getOrCreate())


def _weights(fitted):
    """A fitted model's weights as JSON can carry them: name -> flat float64 values."""
    import torch

    weights = fitted.getModel().state_dict()
    return {name: tensor.to(torch.float64).flatten().tolist() for name, tensor in weights.items()}


def layout(spark, args):
    """Where the ranks land and their allreduce: hierarchical, flat (gloo alone) and over MPI
    (mpi4py on whichever MPI library it runs on)."""
    from sparkring import run

    def where(**how):
        return run(host_fns.where_and_sum, args=(args["floats"],), num_proc=args["ranks"], verbose=0, **how)

    return {"hierarchical": where(), "flat": where(shared_memory=False), "mpi": where(backend="mpi")}


def bandwidth(spark, args):
    from sparkring import run

    return run(host_fns.allreduce_seconds, args=(args["sizes_mb"], args["repeats"], args.get("compression", "none")),
               num_proc=args["ranks"],
               verbose=0, shared_memory=args.get("shared_memory", True))[0]


def cut(spark, args):
    from sparkring import run

    started = time.time()
    try:
        run(host_fns.allreduce_until_stopped, args=(args["flag"],), num_proc=args["ranks"], verbose=1,
            heartbeat_timeout=args["heartbeat_timeout"], timeout=args.get("timeout"))
    except Exception as exc:  # noqa: BLE001 - the scenario reports what reached the caller
        return {"error": type(exc).__name__, "message": str(exc), "at": time.time(), "started": started,
                "hosts": getattr(exc, "hosts", None)}
    return {"error": None, "at": time.time(), "started": started}


def fit(spark, args):
    import est_helpers

    from sparkring import SparkRingEstimator, Store

    # a shuffle reads its blocks in no fixed order: rows sorted within partitions, as every session gets them
    df = est_helpers.classification_df(spark, n=256, partitions=4).sortWithinPartitions("id")
    fitted = SparkRingEstimator(model=est_helpers.mlp(dropout=0.0), optimizer=est_helpers.adam,
                                loss="cross_entropy", featuresCol="features", labelCol="label", batchSize=16,
                                epochs=2, numProc=args["ranks"], store=Store(args["store"]), verbose=0,
                                seed=0).fit(df)
    return {"weights": _weights(fitted)}


def elastic(spark, args):
    """An elastic fit (minProc=2) of 4 ranks whose steps take their time, checkpointing every 4
    steps: its weights and history (the test loses a host meanwhile)."""
    import elastic_fns
    import est_helpers

    from sparkring import SparkRingEstimator, Store

    df = est_helpers.classification_df(spark, n=384, partitions=4).sortWithinPartitions("id")
    fitted = SparkRingEstimator(model=elastic_fns.Paced(seconds=args["pace"]), optimizer=est_helpers.adam,
                                loss="cross_entropy", featuresCol="features", labelCol="label", batchSize=8,
                                epochs=3, numProc=4, minProc=2, store=Store(args["store"]), runId=args["run_id"],
                                checkpointEvery=4, heartbeatTimeout=args["heartbeat_timeout"],
                                startTimeout=args["start_timeout"], verbose=1, seed=5).fit(df)
    return {"weights": _weights(fitted), "history": fitted.history}


def sharded(spark, args):
    """A fit of host_fns.wide_mlp (or ``model="deep"``: deep_mlp) under ``strategy`` (ddp, fsdp or hsdp): its
    training seconds and steps."""
    import est_helpers

    from sparkring import SparkRingEstimator, Store

    batch = args.get("batch", 16)
    df = est_helpers.classification_df(spark, n=args["rows"], partitions=4).sortWithinPartitions("id")
    model = {"wide": host_fns.wide_mlp, "deep": host_fns.deep_mlp}[args.get("model", "wide")]
    fitted = SparkRingEstimator(model=model, optimizer=est_helpers.adam, loss="cross_entropy",
                                featuresCol="features", labelCol="label", batchSize=batch, epochs=1,
                                numProc=args["ranks"], strategy=args["strategy"], store=Store(args["store"]),
                                verbose=0, seed=0).fit(df)
    return {"seconds": fitted.phases.first_step + fitted.phases.epochs, "epoch_seconds": fitted.phases.epochs,
            "steps": args["rows"] // (batch * args["ranks"])}


if __name__ == "__main__":
    master, scenario, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    spark = session(master, args.get("cores_per_host", 2), args.get("hosts", 2))
    spark.sparkContext.setLogLevel("ERROR")
    try:
        scenarios = {"layout": layout, "bandwidth": bandwidth, "cut": cut, "fit": fit, "sharded": sharded,
                     "elastic": elastic}
        result = scenarios[scenario](spark, args)
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        spark.stop()
