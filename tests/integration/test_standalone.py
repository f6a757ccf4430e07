"""A real Spark standalone cluster (a master and two workers on 127.0.0.1, started from the
installed pyspark) whose workers have no sparkring: the environment is shipped with
``make pack`` + ``--archives``; a worker whose Python has other versions is caught by run() and
named by doctor; nothing is left running afterwards."""
import os
import signal
import subprocess
import sys
import time

import pyspark
import pytest
from paths import ROOT
from standalone_cluster import SPARK_HOME, alive_workers, free_port, port_open, processes_under, wait_for

# the skewed worker's Python: a small venv layered over the packed one with another cloudpickle
# (torch's other releases are multi-GB CUDA wheels here; cloudpickle is compared the same way)
SKEWED_CLOUDPICKLE = "3.0.0"

pytestmark = [pytest.mark.slow, pytest.mark.cluster,
              pytest.mark.skipif(pyspark.__version__.startswith("3."),
                                 reason="run with the main environment (pyspark 4); one run of these suffices")]




def _clean_env(**extra):
    """What the cluster's daemons see: no virtualenv, no PYTHONPATH, nothing of sparkring."""
    base = os.path.dirname(os.path.realpath(sys._base_executable))
    env = {"PATH": os.pathsep.join([base, "/usr/local/bin", "/usr/bin", "/bin"]), "HOME": os.environ.get("HOME", "/"),
           "SPARK_HOME": SPARK_HOME, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1",
           "PYSPARK_PYTHON": os.path.realpath(sys._base_executable)}
    if os.environ.get("JAVA_HOME"):
        env["JAVA_HOME"] = os.environ["JAVA_HOME"]
    env.update(extra)
    return env




@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """make pack (stored, not compressed), and the skewed venv beside it."""
    root = tmp_path_factory.mktemp("pack")
    env_tar, venv = root / "env.tar.gz", root / "pack-venv"
    base = os.path.realpath(sys._base_executable)
    subprocess.run(["make", "--no-print-directory", "pack", f"PACK={env_tar}", f"PACK_VENV={venv}", f"PYTHON={base}",
                    "PACK_LEVEL=0"], cwd=ROOT, check=True, timeout=900)
    skewed = root / "skewed-venv"
    subprocess.run([base, "-m", "venv", str(skewed)], check=True)
    site = next((skewed / "lib").glob("python3.*")) / "site-packages"
    packed_site = next((venv / "lib").glob("python3.*")) / "site-packages"
    (site / "packed.pth").write_text(f"{packed_site}\n")  # everything of the packed env, after its own
    subprocess.run([str(skewed / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                    f"cloudpickle=={SKEWED_CLOUDPICKLE}"], check=True, timeout=300)
    return {"tar": env_tar, "python": venv / "bin" / "python", "skewed": skewed / "bin" / "python"}


@pytest.fixture(scope="module")
def cluster(packed, tmp_path_factory):
    """A master and two 1-core workers; worker 1's executors find the packed Python through
    SPARKRING_TEST_PYTHON, worker 2's the skewed one (see the python-of-this-worker wrapper)."""
    root = tmp_path_factory.mktemp("standalone")
    port, ui = free_port(), free_port()
    spark_class = os.path.join(SPARK_HOME, "bin", "spark-class")
    procs = []
    logs = []

    def start(args, log_name, **env):
        log = open(root / log_name, "w")
        logs.append(log)
        procs.append(subprocess.Popen([spark_class, *args], env=_clean_env(**env), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True, cwd=root))

    wrapper = root / "python-of-this-worker"
    wrapper.write_text('#!/bin/sh\nexec "$SPARKRING_TEST_PYTHON" "$@"\n')
    wrapper.chmod(0o755)
    try:
        start(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
               "--webui-port", str(ui)], "master.log")
        wait_for(lambda: port_open(port), 60, "the master did not start")
        for i, python in enumerate([packed["python"], packed["skewed"]]):
            (root / f"work{i}").mkdir()
            start(["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "1", "--memory",
                   "1200m", "--webui-port", str(free_port()), "--work-dir", str(root / f"work{i}"),
                   f"spark://127.0.0.1:{port}"], f"worker{i}.log", SPARKRING_TEST_PYTHON=str(python))
        wait_for(lambda: alive_workers(ui) == 2, 90, "the workers did not register")
        yield {"master": f"spark://127.0.0.1:{port}", "root": root, "wrapper": str(wrapper), **packed}
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        for log in logs:
            log.close()
        wait_for(lambda: not processes_under(root), 30, "cluster processes outlived the test")






def _submit_env():
    """The driver's: its own virtualenv (sparkring installed there), and no PYTHONPATH that the
    executors could inherit the source tree from."""
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)
    return env


def _shipped_conf(cluster):
    return ["--archives", f"{cluster['tar']}#environment", "--conf", "spark.pyspark.python=./environment/bin/python",
            "--conf", f"spark.pyspark.driver.python={sys.executable}", "--conf", "spark.driver.host=127.0.0.1",
            "--conf", "spark.executor.memory=900m", "--conf", "spark.ui.showConsoleProgress=false"]


def test_spark_submit_with_the_packed_environment_runs_doctor_trains_transforms_and_saves(cluster, tmp_path):
    # one application (each one unpacks the archive on every executor): run(), doctor(), then the
    # digits example in the same session
    out = tmp_path / "out"
    submit = os.path.join(SPARK_HOME, "bin", "spark-submit")
    proc = subprocess.run([submit, "--master", cluster["master"], *_shipped_conf(cluster),
                           os.path.join(ROOT, "tests", "helpers", "run_and_doctor.py"),
                           os.path.join(ROOT, "examples", "digits.py"), "--epochs", "10", "--out", str(out)],
                          env=_submit_env(), capture_output=True, text=True, timeout=600, cwd=cluster["root"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # rank 0 imported sparkring from the unpacked archive in its executor's directory
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("rank 0 of 2"))
    assert "/environment/lib/" in line and str(cluster["root"]) in line, proc.stdout
    assert "verdict: ready to train" in proc.stdout.splitlines()
    assert proc.stdout.count("/environment/bin/python") == 2  # each executor's interpreter
    accuracy = float(proc.stdout.split("held-out accuracy: ")[1].split()[0])
    assert accuracy >= 0.95
    assert "reloaded model gives identical predictions: True" in proc.stdout
    assert (out / "digits-model" / "metadata").exists() and (out / "digits_loss.png").stat().st_size > 1000


def _cli(cluster, *args, shipped=True):
    """python -m sparkring ... against the cluster, with the packed environment or (shipped=False)
    each worker's own Python: the packed one on worker 1, the skewed one on worker 2. A driver
    that is a plain Python process (not spark-submit) names the executors' Python with
    PYSPARK_PYTHON, as Spark's docs show for spark.archives."""
    python = "./environment/bin/python" if shipped else cluster["wrapper"]
    archives = f"--archives {cluster['tar']}#environment " if shipped else ""
    env = dict(_submit_env(), PYSPARK_PYTHON=python,
               PYSPARK_SUBMIT_ARGS=f"{archives}--conf spark.driver.host=127.0.0.1 --conf spark.executor.memory=900m "
                                   "pyspark-shell")
    proc = subprocess.run([sys.executable, "-m", "sparkring", args[0], "--master", cluster["master"], *args[1:]],
                          cwd=cluster["root"], env=env, capture_output=True, text=True, timeout=300)
    with open(cluster["root"] / f"cli-{args[0]}-{'shipped' if shipped else 'own'}.log", "w") as f:
        f.write(proc.stdout + proc.stderr)
    return proc


def test_a_worker_with_other_versions_fails_run_fast_and_doctor_names_it(cluster):
    import cloudpickle

    script = os.path.join(ROOT, "tests", "helpers", "where_am_i.py")
    started = time.time()
    run = _cli(cluster, "run", "-np", "2", script, shipped=False)
    assert run.returncode != 0
    message = run.stderr[run.stderr.rindex("sparkring: rank"):]  # what the CLI says last (Spark's log before it)
    assert "the executors run other versions than the driver" in message
    [named] = [ln for ln in message.splitlines() if ln.strip().startswith("executor ")]  # the skewed one only
    assert named.endswith(f"cloudpickle {SKEWED_CLOUDPICKLE} (driver {cloudpickle.__version__})")
    assert time.time() - started < 120
    doctor = _cli(cluster, "doctor", shipped=False)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr[-3000:]
    problems = [ln for ln in doctor.stdout.splitlines() if ln.startswith("PROBLEM")]
    assert len(problems) == 1 and f"cloudpickle {SKEWED_CLOUDPICKLE} (driver {cloudpickle.__version__})" in problems[0]
    skewed = next(ln for ln in doctor.stdout.splitlines()
                  if ln.startswith("executor ") and "skewed-venv" in ln)
    assert skewed.split()[1] in problems[0]  # the problem names that executor
