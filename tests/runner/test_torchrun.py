"""Plain torch.distributed code (torchrun scripts, TorchDistributor functions) run by sparkring."""
import os
import subprocess
import sys
import time

import ddp_fns
import pytest
import torch
from paths import HELPERS, ROOT

from sparkring import RankFailedError, TorchDistributor, run

DDP_SCRIPT = os.path.join(HELPERS, "ddp_fifteen_lines.py")


def _assert_state_equal(a, b, atol=1e-6):
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0)


def test_function_that_inits_torch_distributed_itself_trains_like_one_process(spark):
    results = run(ddp_fns.ddp_user_init, num_proc=2)
    expected = ddp_fns.reference(2)
    for rank, r in enumerate(results):
        _assert_state_equal(r["state"], expected)
        assert all(torch.equal(g, r["gathered"][0]) for g in r["gathered"])
        env = r["env"]
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == str(rank)
        assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "0" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_RUN_ID"]
    # torch's MASTER_PORT is a port of its own, not sparkring's rendezvous store
    assert results[0]["env"]["MASTER_PORT"] != os.environ.get("SPARKRING_MASTER_PORT")


def test_sparkring_collectives_reuse_a_group_the_user_made(spark):
    results = run(ddp_fns.user_init_then_sr, num_proc=2)
    assert [r["total"] for r in results] == [3.0, 3.0]
    assert all(r["same_group"] and r["size"] == 2 and r["backend"] == "gloo" for r in results)


def test_user_init_after_sparkring_formed_the_group_is_adopted(spark):
    results = run(ddp_fns.sr_then_user_ddp, num_proc=2)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        _assert_state_equal(r["state"], ddp_fns.reference(2))


def test_a_rank_raising_inside_ddp_is_named_with_its_traceback(spark):
    with pytest.raises(RankFailedError) as info:
        run(ddp_fns.ddp_fails_on_rank, args=(1,), num_proc=2, verbose=0)
    assert info.value.rank == 1
    assert "bad batch on rank 1" in info.value.remote_traceback


@pytest.mark.compat
def test_torch_distributor_function_gives_the_weights_of_one_process_training(spark):
    # Spark's own TorchDistributor is compared in benchmarks/ (side by side on DDP functions), not
    # here: its torchrun ranks sometimes abort in gloo's teardown at exit ("terminate called
    # without an active exception") and its barrier job then hangs the suite.
    ours = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(ddp_fns.spark_style_train, 0.1)
    assert isinstance(ours, float)
    assert ours == pytest.approx(ddp_fns.one_process_reference(0.1), abs=2e-6)


def test_torch_distributor_runs_a_script_with_arguments_and_returns_none(spark, tmp_path):
    checkpoint = tmp_path / "model.pt"
    script = os.path.join(ROOT, "examples", "ddp_script.py")
    out = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        script, "--epochs", "2", "--checkpoint", str(checkpoint))
    assert out is None
    state = torch.load(checkpoint, weights_only=True)
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_torch_distributor_local_mode_runs_processes_on_the_driver_without_spark_tasks(spark):
    jobs_before = spark.sparkContext.statusTracker().getJobIdsForGroup(None)
    started = time.monotonic()
    ours = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(ddp_fns.spark_style_train, 0.1)
    assert spark.sparkContext.statusTracker().getJobIdsForGroup(None) == jobs_before
    assert ours == TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        ddp_fns.spark_style_train, 0.1)
    with pytest.raises(RankFailedError) as info:
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(ddp_fns.ddp_fails_on_rank, 1)
    assert info.value.rank == 1 and "bad batch on rank 1" in info.value.remote_traceback
    assert time.monotonic() - started < 120


def _cli(*args, timeout=180):
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    return subprocess.run([sys.executable, "-m", "sparkring", "run", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_fifteen_line_ddp_script_and_the_example_run_unchanged_through_the_cli(tmp_path):
    master = "local-cluster[2,1,1024]"  # ranks in two executors (local[2] runs them in one)
    proc = _cli("-np", "2", "--master", master, DDP_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "equal across ranks: True" in proc.stdout
    assert "trying to initialize the default process group twice" not in proc.stderr
    checkpoint = tmp_path / "ddp.pt"  # the example in one executor (no executors to start)
    proc = _cli("-np", "2", "--master", "local[2]", os.path.join(ROOT, "examples", "ddp_script.py"), "--epochs", "2",
                "--checkpoint", str(checkpoint))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "epoch 2/2 loss" in proc.stdout and "weights identical on all ranks: True" in proc.stdout
    assert checkpoint.exists()


def test_distributed_sampler_unused_parameters_and_a_rank_zero_checkpoint_work(spark, tmp_path):
    results = run(ddp_fns.torchrun_habits, args=(str(tmp_path / "ckpt"),), num_proc=2, timeout=60)
    for epoch in range(2):
        a, b = results[0]["shards"][epoch], results[1]["shards"][epoch]
        assert sorted(a + b) == list(range(10)) and not set(a) & set(b)  # disjoint shards, all rows
    assert results[0]["shards"][0] != results[0]["shards"][1]  # set_epoch reshuffles
    assert all(r["restored_equal"] for r in results)


def test_a_ddp_model_dropped_right_after_destroy_process_group_never_hangs_the_rank():
    # torch 2.13's Gloo teardown race (sparkring/collective/_group_lifetime.py): unguarded, this
    # shape hung within 60 attempts in every try; each attempt takes ~15 ms
    script = os.path.join(HELPERS, "ddp_drop_after_destroy.py")
    proc = subprocess.run([sys.executable, script, "200"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all returned" in proc.stdout
    threads = int(proc.stdout.rsplit(":", 1)[1])  # each kept Gloo group holds 3 threads: 40 would be 120+
    assert threads < 30, proc.stdout


def test_torch_distributor_says_its_input_params_and_refuses_gpus_without_the_task_conf(spark):
    d = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    assert d.input_params == {"num_processes": 2, "local_mode": False, "use_gpu": False, "num_tasks": 2}
    assert spark.conf.get("spark.task.resource.gpu.amount", None) is None
    with pytest.raises(RuntimeError, match="'spark.task.resource.gpu.amount' was unset"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=True)
