"""GPU decisions that need no GPU: what Spark's addresses mean to CUDA, which ranks share a
GPU, the backend decided once on the driver, spawn vs fork, tensors shipped on the host,
pinned batches, transform's device; and SyncBatchNorm's float16 statistics on CPU."""
import importlib
import subprocess
import sys
import threading
import types

import pytest
import torch
from spawn import spawn_ranks
from waiting import wait_until

from sparkring import ConfigurationError
from sparkring.estimator.model import task_device
from sparkring.process_start import start_method
from sparkring.runner import plan, to_bytes
from sparkring.runner.gpus import cuda_names, device_ordinal, host_gpus
from sparkring.trainer.batches import pinned
from sparkring.trainer.checkpoints import on_cpu as _on_cpu

plan_module = importlib.import_module("sparkring.runner.driver.plan")  # the package's `plan` is the function


# -- Spark addresses -> CUDA names and ordinals ------------------------------------------------

def test_spark_addresses_are_cuda_names_when_the_executor_sets_no_visible_devices():
    assert cuda_names(["0", "3"], {}) == ["0", "3"]
    assert cuda_names(["GPU-8a1f0c", "MIG-2b4e"], {"CUDA_VISIBLE_DEVICES": ""}) == ["GPU-8a1f0c", "MIG-2b4e"]


def test_a_preset_visible_devices_list_is_respected_by_name_or_by_index():
    slurm = {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert cuda_names(["5"], slurm) == ["5"]            # the same physical name
    assert cuda_names(["1"], slurm) == ["5"]            # an index into what the executor sees
    uuids = {"CUDA_VISIBLE_DEVICES": "GPU-aaa,GPU-bbb"}
    assert cuda_names(["GPU-bbb"], uuids) == ["GPU-bbb"]
    assert cuda_names(["0"], uuids) == ["GPU-aaa"]
    with pytest.raises(ConfigurationError, match=r"address '7', which is neither one of this executor's "
                                                 r"CUDA_VISIBLE_DEVICES=4,5 nor an index into it"):
        cuda_names(["7"], slurm)


def test_device_ordinals_count_in_the_process_own_numbering():
    assert device_ordinal("5", {"CUDA_VISIBLE_DEVICES": "4,5"}) == 1
    assert device_ordinal("1", {"CUDA_VISIBLE_DEVICES": "4,5"}) == 1
    assert device_ordinal("3", {}) == 3
    assert device_ordinal("GPU-bbb", {}, uuids=lambda: ["GPU-aaa", "GPU-bbb"]) == 1
    with pytest.raises(ConfigurationError, match="which torch does not see"):
        device_ordinal("MIG-ccc", {}, uuids=lambda: ["GPU-aaa"])


def test_ranks_of_a_host_share_one_visible_list_ordered_by_local_rank():
    host = host_gpus([["3"], ["1"], ["2"]])
    assert host.visible == ("3", "1", "2") and host.ordinals == (0, 1, 2)  # set_device(local_rank) works
    assert not host.shared
    two_each = host_gpus([["0", "1"], ["2", "3"]])
    assert two_each.visible == ("0", "2", "1", "3") and two_each.ordinals == (0, 1) and not two_each.shared
    halves = host_gpus([["0"], ["0"], ["1"], ["1"]])
    assert halves.shared and halves.visible == ("0", "1") and halves.ordinals == (0, 0, 1, 1)
    with pytest.raises(ConfigurationError, match=r"local rank\(s\) \[1\] were given no GPU"):
        host_gpus([["0"], []])


# -- the backend, decided once on the driver ---------------------------------------------------

def _session(master, driver_gpus=(), **conf):
    """A classic-looking session that only answers what plan() reads."""
    conf = dict(conf, **{"spark.master": master})
    resources = {"gpu": types.SimpleNamespace(addresses=list(driver_gpus))} if driver_gpus else {}
    return types.SimpleNamespace(conf=types.SimpleNamespace(get=lambda k, d=None: conf.get(k, d)),
                                 sparkContext=types.SimpleNamespace(resources=resources))


GPU_CLUSTER = {"spark.executor.resource.gpu.amount": "2", "spark.task.resource.gpu.amount": "1"}
HALF_GPU_CLUSTER = {"spark.executor.resource.gpu.amount": "1", "spark.task.resource.gpu.amount": "0.5"}


@pytest.fixture
def nccl_built(monkeypatch):
    monkeypatch.setattr(plan_module, "nccl_available", lambda: True)


def test_auto_backend_is_nccl_for_whole_gpus_and_gloo_without_gpus(nccl_built):
    gpus = plan(_session("local-cluster[2,2,1024]", **GPU_CLUSTER), 4)
    assert (gpus.use_gpu, gpus.backend, gpus.backend_from_auto) == (True, "nccl", True)
    cpus = plan(_session("local-cluster[2,2,1024]"), 4)
    assert (cpus.use_gpu, cpus.backend) == (False, "gloo")
    assert plan(_session("local-cluster[2,2,1024]", **GPU_CLUSTER), 4, backend="gloo").backend == "gloo"


def test_auto_backend_is_gloo_when_torch_has_no_nccl(monkeypatch):
    monkeypatch.setattr(plan_module, "nccl_available", lambda: False)
    assert plan(_session("local-cluster[2,2,1024]", **GPU_CLUSTER), 4).backend == "gloo"


def test_ranks_sharing_a_gpu_refuse_nccl_and_auto_picks_gloo_with_one_warning(nccl_built, caplog):
    with pytest.raises(ConfigurationError, match=r"backend='nccl' but ranks on one host would share a GPU"):
        plan(_session("local-cluster[2,2,1024]", **HALF_GPU_CLUSTER), 4, backend="nccl")
    caplog.clear()
    with caplog.at_level("WARNING", logger="sparkring.runner.driver.plan"):
        half = plan(_session("local-cluster[2,2,1024]", **HALF_GPU_CLUSTER), 4)
    assert half.backend == "gloo" and half.use_gpu
    assert [r.getMessage() for r in caplog.records if "share a GPU" in r.getMessage()] == [
        "ranks on one host share a GPU, which NCCL refuses: backend='auto' uses gloo; give every task a whole GPU "
        "(spark.task.resource.gpu.amount=1) for NCCL"]
    assert plan(_session("local[2]", driver_gpus=["0", "1"]), 2, use_gpu=True).backend == "nccl"


def test_task_gpus_in_local_mode_are_refused_before_any_job_naming_the_driver_gpus_instead():
    # local mode never schedules a task that asks for a GPU: the ranks would wait forever
    for amount in ("0.5", "1"):
        with pytest.raises(ConfigurationError, match=rf"spark.task.resource.gpu.amount={amount} in local mode: Spark "
                                                     r"never schedules.*spark.driver.resource.gpu.amount"):
            plan(_session("local[2]", driver_gpus=["0", "1"], **{"spark.task.resource.gpu.amount": amount}), 2)


# -- how ranks start, what they are shipped --------------------------------------------------

def test_ranks_fork_beside_other_threads_and_spawn_only_for_cuda_or_when_asked(monkeypatch):
    assert start_method(uses_gpu=True, env={}).method == "spawn"
    assert start_method(uses_gpu=True, env={"SPARKRING_WORKER_START": "fork"}).method == "fork"
    assert start_method(uses_gpu=False, env={"SPARKRING_WORKER_START": "spawn"}).method == "spawn"
    with pytest.raises(ValueError, match="SPARKRING_WORKER_START='thread': use one of fork, spawn"):
        start_method(uses_gpu=False, env={"SPARKRING_WORKER_START": "thread"})
    # another OS thread (pyarrow's jemalloc one, gloo's) is no reason to spawn
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
    try:
        assert start_method(uses_gpu=False, env={}).method == "fork"
    finally:
        stop.set()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    held = start_method(uses_gpu=False, env={})
    assert held.method == "spawn" and "initialised CUDA" in held.reason


FORK_KEEPS_NUMBERS = """
import os, sys
from sparkring.runner.task.process import open_files, release_inherited
old_rule = sys.argv[1] == "close"
inherited_object = open(os.devnull)          # a Python object the child inherits, owning a descriptor
files = open_files()
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_RDONLY)
    if old_rule:
        for fd in files:
            if fd > 2:
                try:
                    os.close(fd)
                except OSError:
                    pass
    else:
        release_inherited(files, null)
    r, w = os.pipe()                          # the child's own descriptors (libuv's signal pipe, say)
    inherited_object.close()                  # the inherited object is collected: closes "its" number
    try:
        os.write(w, b"x")
        os._exit(0 if os.read(r, 1) == b"x" else 3)
    except OSError:
        os._exit(4)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.parametrize("rule, child_exit", [("release", 0), ("close", 4)])
def test_a_forked_rank_keeps_the_numbers_of_inherited_descriptors_taken(rule, child_exit):
    # the old rule (close them) lets the child's own pipe take a number that a stale close then
    # takes away: what aborted rank 0's TCPStore (libuv) after mlflow's spark_udf
    out = subprocess.run([sys.executable, "-c", FORK_KEEPS_NUMBERS, rule], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == [str(child_exit)]


def test_shipped_tensors_keep_shared_parameters_shared():
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    tied = torch.nn.Sequential(net, torch.nn.ReLU())
    back_net, back_opt, back_tied = __import__("cloudpickle").loads(to_bytes((net, opt, tied)))
    assert back_opt.param_groups[0]["params"][0] is back_net.weight
    assert back_tied[0] is back_net
    assert torch.equal(back_net.weight, net.weight)


def test_checkpoint_state_is_copied_to_the_cpu_in_its_containers():
    state = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {0: {"momentum": torch.zeros(2)}},
                                                          "param_groups": [{"params": [0], "lr": 0.1}]},
             "history": [{"loss": 1.0}], "early_stopping": (None, 0)}
    out = _on_cpu(state)
    assert out["optimizer"]["param_groups"] == [{"params": [0], "lr": 0.1}] and out["early_stopping"] == (None, 0)
    assert torch.equal(out["optimizer"]["state"][0]["momentum"], torch.zeros(2))


# -- pinned batches ------------------------------------------------------------------------------

def test_pinned_batches_arrive_in_order_and_stop_their_thread_when_the_loop_stops():
    made = []

    def batches():
        for i in range(100):
            made.append(i)
            yield {"x": torch.full((2,), float(i)), "raw": [i]}

    out = pinned(batches(), pin=torch.Tensor.clone, depth=2)
    got = [next(out) for _ in range(3)]
    assert [b["x"][0].item() for b in got] == [0.0, 1.0, 2.0] and got[2]["raw"] == [2]
    out.close()
    assert len(made) <= 3 + 2 + 1  # read ahead by at most depth (+ the one waiting to be put)
    wait_until(lambda: not any(t.name == "sparkring-prefetch" for t in threading.enumerate()), timeout=2)
    assert not any(t.name == "sparkring-prefetch" for t in threading.enumerate())


def test_pinned_batches_raise_the_reader_error_on_the_training_thread():
    def failing():
        yield {"x": torch.zeros(1)}
        raise OSError("the Parquet file went away")

    out = pinned(failing(), pin=torch.Tensor.clone)
    next(out)
    with pytest.raises(OSError, match="went away"):
        next(out)


# -- transform's device -------------------------------------------------------------------------

def test_transform_runs_on_cpu_when_use_gpu_is_off_and_refuses_use_gpu_without_cuda():
    assert task_device(False) == torch.device("cpu")
    assert task_device(None) == torch.device("cpu")  # no GPU assigned to this (non-)task
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="useGpu=True but torch on this executor has no CUDA device"):
            task_device(True)


# -- SyncBatchNorm in float16 -----------------------------------------------------------------

@pytest.mark.slow
def test_sync_batch_norm_in_float16_matches_float32_batch_norm_past_65504_values_per_channel():
    # 16 x 64 x 64 = 65536 values per channel and rank: a float16 count or sum of squares is inf
    results = spawn_ranks("gpu_fns", "sync_batch_norm_half", 2)
    whole = results[0]["whole"].float()
    expected = torch.nn.functional.batch_norm(whole, None, None, training=True, eps=1e-5)
    got = torch.cat([r["out"] for r in results])
    assert torch.isfinite(got).all()
    assert torch.allclose(got, expected, atol=2e-2), (got - expected).abs().max()
    unbiased = whole.transpose(0, 1).reshape(2, -1).var(dim=1)
    assert torch.allclose(results[0]["running_var"], 0.9 + 0.1 * unbiased, rtol=1e-2)
