"""Shared Spark sessions for the suite: one local[2], one local-cluster[2,1,1024], one
local[2,3] (task retries), created on demand, one at a time (Spark allows one
SparkContext per process), and stopped at the end; and one Spark Connect session.

The Connect session talks to a Spark Connect server in a process of its own, started from the
installed pyspark (``spark-submit --class ...SparkConnectServer``, bound to 127.0.0.1): that is
what a real deployment looks like (the client has no JVM, no SparkContext, and reaches the
server over gRPC only), where ``builder.remote("local[2]")`` would run the server inside the
test process and let classic-only calls slip through unnoticed. Its master is local[2,2] with
two stage attempts, so barrier-stage retries are tested over Connect too (one retry: each test
that fails every attempt waits through them all). Connect tests run last: pyspark marks the
whole process as "Connect mode" once a remote session exists."""
from __future__ import annotations

import os
import sys

import pytest
from connect_server import ConnectServer  # tests/helpers/ is on sys.path (pyproject's pytest pythonpath)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
HELPERS_DIR = os.path.join(TESTS_DIR, "helpers")
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
# Test modules must be importable by Spark's Python workers (functions pickle by reference): the
# helpers at tests/helpers/ and each layer's test modules in their folders.
TEST_FOLDERS = [HELPERS_DIR, TESTS_DIR] + sorted(
    os.path.join(TESTS_DIR, d) for d in os.listdir(TESTS_DIR)
    if os.path.isdir(os.path.join(TESTS_DIR, d)) and any(
        f.startswith("test_") and f.endswith(".py") for f in os.listdir(os.path.join(TESTS_DIR, d))))
os.environ["PYTHONPATH"] = os.pathsep.join(
    TEST_FOLDERS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ.setdefault("OMP_NUM_THREADS", "1")

FAKE_GPU_SCRIPT = os.path.join(TESTS_DIR, "helpers", "fake_gpus.sh")
FAKE_GPUS_PER_WORKER_SCRIPT = os.path.join(TESTS_DIR, "helpers", "fake_gpus_per_worker.sh")
REAL_GPU_SCRIPT = os.path.join(TESTS_DIR, "helpers", "cuda_gpus.sh")

MASTERS = {
    "local": "local[2]",
    "retry": "local[2,3]",
    "wide": "local[3]",
    "cluster": "local-cluster[2,1,1024]",
    "multigpu": "local-cluster[2,1,1024]",
    "gpu": "local[2]",
    "hosts": None,  # a standalone cluster of two workers on 127.0.0.2 and 127.0.0.3 (two "hosts"), two cores each
    "elastic": None,  # a standalone cluster of three one-core workers (127.0.0.2-4), which its test kills
    # and decommissions
    "autoscale": None,  # three one-core workers (127.0.0.2-4) under dynamic allocation: 0 to 2 executors
}
ORDER = ["local", "retry", "wide", "cluster", "multigpu", "hosts", "elastic", "autoscale", "gpu", "connect"]
CLUSTERS = {"hosts": (["127.0.0.2", "127.0.0.3"], 2), "elastic": (["127.0.0.2", "127.0.0.3", "127.0.0.4"], 1),
            "autoscale": (["127.0.0.2", "127.0.0.3", "127.0.0.4"], 1)}


def _spark_major() -> int:
    import pyspark

    return int(pyspark.__version__.split(".")[0])


# pyspark 3.5's wheel has no Spark Connect server (it comes from Maven, out of reach here)
CONNECT_SERVER_MISSING = "pyspark < 4 ships no Spark Connect server jar" if _spark_major() < 4 else None
CONNECT_MASTER = "local[2,2]"
# a barrier stage is retried up to spark.stage.maxConsecutiveAttempts times, whatever the master says
CONNECT_CONFS = {"spark.stage.maxConsecutiveAttempts": "2"}


class _Sessions:
    def __init__(self):
        self.kind = None
        self.spark = None
        self.server = None
        self.cluster = None

    def get(self, kind: str, log_dir: str = "/tmp"):
        if self.kind == kind:
            return self.spark
        self.stop()
        from pyspark.sql import SparkSession

        if kind == "connect":
            if self.server is None:
                self.server = ConnectServer(log_dir, CONNECT_MASTER, CONNECT_CONFS)
            self.spark = SparkSession.builder.remote(self.server.url).getOrCreate()
            self.kind = kind
            return self.spark

        master = MASTERS[kind]
        if kind in CLUSTERS:
            import tempfile

            from standalone_cluster import StandaloneCluster

            hosts, cores = CLUSTERS[kind]
            env = dict(os.environ)
            if kind == "elastic":  # a worker sent SIGPWR decommissions its executors
                env["SPARK_WORKER_OPTS"] = "-Dspark.decommission.enabled=true"
            self.cluster = StandaloneCluster(tempfile.mkdtemp(prefix=f"sparkring-{kind}-", dir=log_dir),
                                             env).start(hosts, cores=cores)
            master = self.cluster.master
        builder = (SparkSession.builder.master(master).appName(f"sparkring-tests-{kind}")
                   .config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false")
                   .config("spark.sql.shuffle.partitions", "4")
                   .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
                   .config("spark.executorEnv.OMP_NUM_THREADS", "1")
                   .config("spark.python.worker.reuse", "true"))
        if kind not in CLUSTERS:  # there each worker's executors listen on the worker's own address
            builder = builder.config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1")
        else:
            builder = builder.config("spark.executor.memory", "900m")
        if kind == "retry":  # three attempts of a barrier stage, as local[2,3] says for other stages
            builder = builder.config("spark.stage.maxConsecutiveAttempts", "3")
        if kind == "elastic":
            builder = builder.config("spark.decommission.enabled", "true")
        if kind == "autoscale":  # no executor until a job asks; an idle one goes after 5 s
            builder = (builder.config("spark.dynamicAllocation.enabled", "true")
                       .config("spark.dynamicAllocation.shuffleTracking.enabled", "true")
                       .config("spark.dynamicAllocation.minExecutors", "0")
                       .config("spark.dynamicAllocation.initialExecutors", "0")
                       .config("spark.dynamicAllocation.maxExecutors", "2")
                       .config("spark.dynamicAllocation.executorIdleTimeout", "5s")
                       .config("spark.executor.cores", "1"))
        if kind == "local":
            # Fake driver GPUs, as Spark's own tests do: local-mode GPU assignment is testable.
            builder = (builder.config("spark.driver.resource.gpu.amount", "2")
                       .config("spark.driver.resource.gpu.discoveryScript", FAKE_GPU_SCRIPT))
        if kind == "gpu":
            # The machine's real GPUs (tests/gpu, make gpu-check), as the driver's resources: local
            # mode's ranks take them by local rank. With Spark 3.5 and 4.3 a spark.task.resource.gpu.amount in
            # local mode is refused without spark.executor.resource.gpu.amount, and with it no task
            # is ever scheduled.
            import torch

            builder = (builder.config("spark.driver.resource.gpu.amount", str(torch.cuda.device_count()))
                       .config("spark.driver.resource.gpu.discoveryScript", REAL_GPU_SCRIPT))
        if kind == "cluster":
            builder = (builder.config("spark.executor.memory", "768m")
                       .config("spark.worker.resource.gpu.amount", "1")
                       .config("spark.worker.resource.gpu.discoveryScript", FAKE_GPU_SCRIPT)
                       .config("spark.executor.resource.gpu.amount", "1")
                       .config("spark.task.resource.gpu.amount", "1"))
        if kind == "multigpu":
            import shutil
            import tempfile

            # one host with four GPUs, two per executor: a copy of the script in a directory of
            # its own, where the first worker leaves its mark
            script = shutil.copy(FAKE_GPUS_PER_WORKER_SCRIPT, tempfile.mkdtemp(prefix="sparkring-gpus-", dir=log_dir))
            builder = (builder.config("spark.executor.memory", "768m")
                       .config("spark.worker.resource.gpu.amount", "2")
                       .config("spark.worker.resource.gpu.discoveryScript", script)
                       .config("spark.executor.resource.gpu.amount", "2")
                       .config("spark.task.resource.gpu.amount", "1"))
        self.spark = builder.getOrCreate()
        self.kind = kind
        if kind in CLUSTERS and kind != "autoscale":  # the executors register after the session starts
            from sparkring.runner.driver.session import wait_for_slots

            hosts, cores = CLUSTERS[kind]
            assert wait_for_slots(self.spark, cores * len(hosts), timeout=90), "the executors did not register"
        return self.spark

    def stop(self):
        if self.spark is not None and self.kind == "connect":
            self.spark.stop()
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)  # back to classic for what follows
            self.spark = None
            self.kind = None
        if self.spark is not None:
            self.spark.stop()
            from pyspark import SparkContext

            SparkContext._active_spark_context = None
            self.spark = None
            self.kind = None
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def stop_server(self):
        self.stop()
        if self.server is not None:
            self.server.stop()
            self.server = None


_sessions = _Sessions()


@pytest.fixture(scope="session")
def _s3_server():
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    from s3_server import S3Server

    server = S3Server().start()
    server.make_bucket("runs")
    yield server
    server.stop()


@pytest.fixture
def s3(_s3_server):
    """An S3 API server on loopback (moto) with the bucket ``runs``: ``s3.store(prefix)`` is a
    Store in it; a test may stop it (``stop_on``), the next one finds it running again."""
    return _s3_server.running()


@pytest.fixture(scope="session")
def _spark_sessions():
    yield _sessions
    _sessions.stop_server()


@pytest.fixture
def spark(_spark_sessions):
    """local[2] session (with two fake driver GPUs)."""
    return _spark_sessions.get("local")


@pytest.fixture
def spark_retry(_spark_sessions):
    """local[2,3]: Spark retries failed tasks, and barrier stages (three attempts: a barrier
    stage's attempts are spark.stage.maxConsecutiveAttempts, set to 3 here)."""
    return _spark_sessions.get("retry")


@pytest.fixture
def spark_wide(_spark_sessions):
    """local[3]: three task slots (three ranks on one host)."""
    return _spark_sessions.get("wide")


@pytest.fixture
def spark_cluster(_spark_sessions):
    """local-cluster[2,1,1024]: two executor JVMs, one core each, one fake GPU each."""
    return _spark_sessions.get("cluster")


@pytest.fixture
def spark_multigpu(_spark_sessions, tmp_path_factory):
    """local-cluster[2,1,1024] as one host with four fake GPUs: two per executor (0-1 and 2-3),
    one per task unless a stage asks for more (spark.task.resource.gpu.amount=1)."""
    return _spark_sessions.get("multigpu", str(tmp_path_factory.getbasetemp()))


@pytest.fixture
def spark_gpu(_spark_sessions):
    """local[2] on the machine's real GPUs (skipped where torch sees none)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: GPU checks run with make gpu-check on a machine with GPUs")
    return _spark_sessions.get("gpu")


@pytest.fixture
def spark_connect(_spark_sessions, tmp_path_factory):
    """A Spark Connect session on a server process (master local[2,2], two stage attempts) bound
    to 127.0.0.1."""
    if CONNECT_SERVER_MISSING:
        pytest.skip(CONNECT_SERVER_MISSING)
    return _spark_sessions.get("connect", str(tmp_path_factory.getbasetemp()))


@pytest.fixture
def connect_url(spark_connect):
    return _sessions.server.url


@pytest.fixture
def spark_hosts(_spark_sessions, tmp_path_factory):
    """A standalone cluster whose two workers are two hosts (127.0.0.2 and 127.0.0.3, two cores
    each): four ranks, two per host."""
    return _spark_sessions.get("hosts", str(tmp_path_factory.getbasetemp()))


@pytest.fixture
def spark_autoscale(_spark_sessions, tmp_path_factory):
    """A standalone cluster of three one-core workers under dynamic allocation (shuffle tracking,
    0 to 2 executors, released after 5 idle seconds): the application starts with no executor."""
    return _spark_sessions.get("autoscale", str(tmp_path_factory.getbasetemp()))


@pytest.fixture
def spark_elastic(_spark_sessions, tmp_path_factory):
    """A standalone cluster of three one-core workers (three ranks, one per host); the test may
    kill workers, so the session ends with it."""
    yield _spark_sessions.get("elastic", str(tmp_path_factory.getbasetemp()))
    _spark_sessions.stop()


SESSION_FIXTURES = {"spark_hosts": "hosts", "spark_elastic": "elastic", "spark": "local", "spark_retry": "retry",
                    "spark_wide": "wide", "spark_cluster": "cluster", "spark_multigpu": "multigpu",
                    "spark_autoscale": "autoscale",
                    "spark_gpu": "gpu", "spark_connect": "connect", "connect_url": "connect"}
# Modules whose tests start processes of their own (spawned ranks, CLI subprocesses, mpiexec).
PROCESS_MODULES = {"test_conformance", "test_horovod", "test_mpi", "test_torchrun", "test_inputs", "test_shm",
                   "test_examples", "test_sharding"}

# What the compat environment (pyspark 3.5, pyarrow 14, numpy 1, petastorm) runs is marked at each
# test, `@pytest.mark.compat` (a parameter case: `pytest.param(..., marks=pytest.mark.compat)`):
# `make test-compat` runs those and the fast layer, `make test-compat FULL=1` everything. Marked: the
# version-dependent tests (petastorm, persistence, spark-submit, Arrow/Parquet decoding, MLflow,
# Lightning) and one test of most other modules as a cross-section.


def pytest_collection_modifyitems(config, items):
    """Mark what is slow (a Spark session, processes of its own) and what needs MPI or a
    cluster, so ``-m "not slow"`` is the fast layer; group tests by the session they use so
    each session starts once."""
    for item in items:
        if getattr(item, "module", None) is None:  # a docstring example of sparkring/: fast
            continue
        names = set(getattr(item, "fixturenames", ()))
        sessions = {SESSION_FIXTURES[n] for n in names if n in SESSION_FIXTURES}
        if sessions or item.module.__name__ in PROCESS_MODULES:
            item.add_marker(pytest.mark.slow)
        if sessions & {"cluster", "multigpu", "hosts", "elastic", "autoscale"}:
            item.add_marker(pytest.mark.cluster)
        if "connect" in sessions:
            item.add_marker(pytest.mark.connect)
        if "gpu" in sessions:
            item.add_marker(pytest.mark.gpu)
        if item.module.__name__ == "test_mpi" or "mpi" in item.name:
            item.add_marker(pytest.mark.mpi)

    def key(item):
        names = getattr(item, "fixturenames", ())
        for i, kind in enumerate(ORDER):
            fixture = {"local": "spark", "retry": "spark_retry", "wide": "spark_wide", "cluster": "spark_cluster",
                       "multigpu": "spark_multigpu", "hosts": "spark_hosts", "autoscale": "spark_autoscale",
                       "elastic": "spark_elastic", "gpu": "spark_gpu", "connect": "spark_connect"}[kind]
            if fixture in names:
                return i + 1
        return 0
    items.sort(key=key)
