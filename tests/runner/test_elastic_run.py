"""Horovod's elastic API in run() and the CLI: TorchState commits persist and the next launch
resumes from them (reset callbacks, sync), a commit the driver asked to stop at ends the launch,
and Horovod's elastic MNIST example goes on with fewer ranks when an executor is lost and grows
back when it returns."""
import os
import re
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from paths import ROOT

import sparkring.collective as hvd
from sparkring.collective import elastic, hosting


def _add_one_per_epoch(state):
    for state.epoch in range(state.epoch, 3):  # noqa: B020 - Horovod's idiom
        state.batch += 1
        with torch.no_grad():
            state.model.weight.add_(1.0)
        state.commit()


def test_a_commit_persists_and_the_next_launch_resumes_from_it_with_its_reset_callbacks(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKRING_ELASTIC_DIR", str(tmp_path))
    hvd.init()
    try:
        train = hvd.elastic.run(_add_one_per_epoch)
        resets = []

        def state_of(model):
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            state = hvd.elastic.TorchState(model, opt, epoch=0, batch=0)
            state.register_reset_callbacks([lambda: resets.append(hvd.size())])
            return state

        torch.manual_seed(0)
        first = state_of(torch.nn.Linear(2, 1))
        start = first.model.weight.detach().clone()
        elastic.stop_request_in(str(tmp_path)).make(elastic.GROW)  # the driver has more slots
        assert hosting.call_user_code(train, (first,), None) == elastic.Paused(commits=1)
        assert resets == []  # a launch that resumed nothing resets nothing

        elastic.stop_request_in(str(tmp_path)).clear()  # the driver clears it before the next launch
        second = state_of(torch.nn.Linear(2, 1))
        assert hosting.call_user_code(train, (second,), None) is None
        assert resets == [1]  # called once, when the launch resumed, with this launch's size
        # resumed at epoch 0's commit (one +1), then epochs 0, 1 and 2 again: +4 in all
        torch.testing.assert_close(second.model.weight, start + 4)
        assert (second.epoch, second.batch, second.commits) == (2, 4, 4)

        monkeypatch.delenv("SPARKRING_ELASTIC_DIR")  # outside an elastic run commits stay in memory
        third = state_of(torch.nn.Linear(2, 1))
        third.batch = 7
        third.restore()
        assert third.batch == 0 and not os.path.exists(tmp_path / "nothing-new")
    finally:
        hvd.shutdown()


def test_an_elastic_sampler_goes_on_where_the_commit_left_off_with_another_number_of_ranks(monkeypatch):
    hvd.init()
    try:
        sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=True, seed=3)
        order = list(sampler)
        sampler.record_batch(0, 4)
        saved = sampler.state_dict()
        again = hvd.elastic.ElasticSampler(list(range(10)), shuffle=True, seed=3)
        again.load_state_dict(saved)
        assert list(again) == order[4:] and len(again) == 6
    finally:
        hvd.shutdown()


def test_elastic_settings_are_refused_before_any_job(spark):
    from sparkring import ConfigurationError, run

    with pytest.raises(ConfigurationError, match=r"min_proc=3: it must be between 1 and num_proc=2"):
        run(lambda: 0, num_proc=2, min_proc=3, spark=spark)


def _executors_under(pid):
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in p.cmdline():
                found.append(p)
        except psutil.Error:
            pass
    return found


def _keep_one_executor_down(proc, started, until):
    """Once training runs, kill an executor, and every executor the cluster starts in its place
    until the run went on without it; then let it come back."""
    while not started.wait(0.2):
        if proc.poll() is not None:
            return
    first = _executors_under(proc.pid)
    first[0].kill()
    survivors = {p.pid for p in first[1:]}
    while not until.is_set() and proc.poll() is None:
        for p in _executors_under(proc.pid):
            if p.pid not in survivors:
                p.kill()
        time.sleep(0.2)


@pytest.mark.slow  # a local-cluster application of its own
def test_horovods_elastic_mnist_example_shrinks_when_an_executor_is_lost_and_grows_back(tmp_path):
    script = os.path.join(ROOT, "examples", "horovod_elastic_mnist.py")
    assert "import sparkring.collective as hvd  # was: import horovod.torch as hvd" in open(script).read()
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               PYSPARK_SUBMIT_ARGS="--conf spark.deploy.maxExecutorRetries=1000 --conf spark.executor.memory=512m "
                                   "pyspark-shell")
    # two one-core executors; one is lost for longer than start_timeout, then comes back
    proc = subprocess.Popen([sys.executable, "-m", "sparkring", "run", "--master", "local-cluster[2,1,1024]",
                             "-np", "2", "--min-np", "1", "--start-timeout", "15", script, "--epochs", "6",
                             "--train-size", "6144", "--lr", "0.05", "--log-interval", "16"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started, shrunk = threading.Event(), threading.Event()
    threading.Thread(target=_keep_one_executor_down, args=(proc, started, shrunk), daemon=True).start()
    out, err = [], []

    def read_stderr():
        for line in proc.stderr:
            err.append(line)
            if "going on with 1 of 2" in line:
                shrunk.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    for line in proc.stdout:
        out.append(line)
        if line.startswith("Train Epoch: 2"):
            started.set()
    proc.wait(300)
    reader.join(10)
    stdout, stderr = "".join(out), "".join(err)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    said = [ln for ln in stderr.splitlines() if ln.startswith("sparkring: ")]
    assert len(said) == 3, "\n".join(said)
    assert re.search(r"^sparkring: lost rank [01] \(executor [\w.-]+:\d+\)(: .*)?: going on with 1 of 2 ranks from the "
                     r"last commit \(restart 1 of at most 3\)$", said[0]), said
    assert "2 task slots again" in said[1], said
    assert "the slots are back: going on with 2 of 2 ranks" in said[2], said
    # the reset callback ran in each later launch, with its number of ranks
    assert re.findall(r"^reset: (\d) ranks", stdout, re.M) == ["1", "2"], stdout[-3000:]
    epochs = [int(e) for e in re.findall(r"^Train Epoch: (\d)", stdout, re.M)]
    assert epochs == sorted(epochs) and epochs[-1] == 6  # never back to an earlier epoch
    assert stdout.count("Test set:") == 1
    accuracy = float(re.search(r"Accuracy: ([\d.]+)%", stdout).group(1))
    assert accuracy >= 80.0, stdout[-2000:]
