"""Horovod drop-in: horovod.torch-style code runs with `import sparkring.collective as hvd`."""
import os
import re
import subprocess
import sys

import hvd_fns
import pytest
import torch
from paths import ROOT
from spawn import spawn_ranks

from sparkring import run
from sparkring.collective._adasum import adasum_pair


def _spawn_ranks(fn_name, size, **kwargs):
    return spawn_ranks("hvd_fns", fn_name, size, **kwargs)


@pytest.mark.parametrize("size", [2, 4])
def test_adasum_matches_a_direct_computation(size):
    results = _spawn_ranks("adasum_of_rank_vectors", size)
    vs = [r["mine"] for r in results]
    if size == 2:
        expected = adasum_pair(vs[0], vs[1])
    else:
        expected = adasum_pair(adasum_pair(vs[0], vs[1]), adasum_pair(vs[2], vs[3]))
    for r in results:
        torch.testing.assert_close(r["adasum"], expected, atol=1e-12, rtol=0)
    # and it is not simply the sum or the mean
    assert not torch.allclose(expected, sum(vs)) and not torch.allclose(expected, sum(vs) / size)


@pytest.mark.compat
def test_horovod_collectives_keep_horovods_semantics_and_keywords(spark):
    r0, r1 = run(hvd_fns.horovod_surface, num_proc=2)
    assert r0["flags"] == (True, True, True, False, 0, 1)  # mpi4py installed, but this ring runs on gloo
    for r in (r0, r1):
        assert r["avg_kw"] == [1.5, 3.0] and r["sum_kw"] == [3.0, 6.0]
        assert r["scaled"] == [3.0, 6.0] and r["product"] == [2.0, 8.0]
        assert r["poll_then_sync"] == [3.0, 6.0]
        assert r["grouped"] == [[3.0, 6.0], [1.0, 1.0, 1.0]]
        assert r["broadcast_"] == [6] and r["bcast_async"] == [0]
    assert (r0["alltoall"], r1["alltoall"]) == ([0, 1, 10, 11], [2, 3, 12, 13])
    assert (r0["alltoall_splits"], r1["alltoall_splits"]) == ([0, 10, 11], [1, 2, 12])
    assert (r0["alltoall_received"], r1["alltoall_received"]) == ([1, 2], [2, 1])
    assert (r0["reducescatter"], r1["reducescatter"]) == ([[3.0, 3.0]] * 3, [[3.0, 3.0]] * 2)
    for r in (r0, r1):  # every rank raises, naming both sides
        assert re.search(r"rank 0 called allreduce, shape \(2,\) torch.float32.* but rank 1 called allreduce, "
                         r"shape \(3,\) torch.float32", r["mismatch"])


def test_sync_batch_norm_over_two_ranks_equals_batch_norm_on_the_whole_batch(spark):
    r0, r1 = run(hvd_fns.sync_batch_norm_grads, num_proc=2)
    torch.manual_seed(0)
    x = torch.randn(8, 3, 4).requires_grad_(True)
    bn = torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
    out = bn(x)
    w = torch.arange(48).reshape(4, 3, 4).float()
    (out * torch.cat([w, w])).sum().backward()
    torch.testing.assert_close(torch.cat([r0["out"], r1["out"]]), out.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([r0["dx"], r1["dx"]]), x.grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(r0["dw"], bn.weight.grad, atol=1e-3, rtol=0)
    torch.testing.assert_close(r0["running_mean"], bn.running_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(r1["running_var"], bn.running_var, atol=1e-5, rtol=0)


@pytest.mark.parametrize("use_adasum", [False, True])
def test_imagenet_style_loop_with_warmup_metrics_resume_fp16_and_two_passes_per_step(spark, use_adasum):
    r0, r1 = run(hvd_fns.imagenet_in_miniature, kwargs={"use_adasum": use_adasum}, num_proc=2)
    assert r0["resume"] == r1["resume"] == 1  # rank 0's resume epoch reached rank 1
    assert r0["losses"] == r1["losses"]  # Metric averages are global
    assert r0["losses"][-1] < r0["losses"][0]
    torch.testing.assert_close(r0["weights"], r1["weights"], atol=0, rtol=0)
    if not use_adasum:
        assert r0["lr"] == pytest.approx(0.05 * 2 * 2)  # warmed up to base_lr * size * passes


def test_horovod_mnist_script_runs_on_spark_with_only_its_import_changed_and_resumes_from_its_checkpoint(tmp_path):
    script = os.path.join(ROOT, "examples", "horovod_mnist.py")
    source = open(script).read()
    code = source.split('"""', 2)[2]  # after the module docstring
    assert code.count("sparkring") == 1  # the one changed import line
    assert "import sparkring.collective as hvd  # was: import horovod.torch as hvd" in source
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)

    def train(epochs):
        proc = subprocess.run([sys.executable, "-m", "sparkring", "run", "-np", "2", "--master", "local[2]", script,
                               "--epochs", str(epochs), "--checkpoint-dir", str(tmp_path), "--train-size", "1024"],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc.stdout, [float(x) for x in re.findall(r"Test set: Average loss: ([0-9.]+)", proc.stdout)]

    first, losses = train(2)
    assert len(losses) == 2 and losses[-1] < losses[0] and "Resumed" not in first
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1.pt", "checkpoint-2.pt"]
    # the second run starts at the saved epoch, with rank 0's SGD+momentum state on every rank
    second, more = train(3)
    assert "Resumed from epoch 2: momentum buffers equal on 2 ranks" in second, second[-2000:]
    assert re.search(r"Train Epoch: 3 ", second) and not re.search(r"Train Epoch: [12] ", second)
    assert len(more) == 1 and more[0] < losses[0]
    assert os.path.getsize(tmp_path / "checkpoint-3.pt") > 10_000


def test_horovods_own_mnist_example_trains_through_both_of_its_launch_lines(tmp_path):
    """examples/pytorch/pytorch_mnist.py from Horovod, its import lines swapped: the seeds'
    ``horovodrun -np 2 -H localhost:2 python train.py`` line and the script's own ``--num-proc``
    path (horovod.run(main, args=..., np=..., hosts=..., use_gloo=..., use_mpi=...))."""
    folder = os.path.join(ROOT, "tests", "horovod_examples")
    script = os.path.join(folder, "pytorch_mnist.py")
    code = open(script).read().split("\n", 2)[2]  # below the two lines saying where it comes from
    assert [line for line in code.splitlines() if "sparkring" in line] == [
        "import sparkring as horovod  # was: import horovod",
        "import sparkring.collective as hvd  # was: import horovod.torch as hvd"]
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([folder, os.environ.get("PYTHONPATH", "")]), HOME=str(tmp_path))
    lines = {"horovodrun": [sys.executable, "-m", "sparkring", "run", "-np", "2", "-H", "localhost:2", "python",
                            script],
             "--num-proc": [sys.executable, script, "--num-proc", "2", "--communication", "gloo"]}
    for name, line in lines.items():
        proc = subprocess.run(line + ["--epochs", "2", "--data-dir", str(tmp_path)], capture_output=True, text=True,
                              env=env, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, name + proc.stdout[-2000:] + proc.stderr[-3000:]
        accuracy = [float(a) for a in re.findall(r"Accuracy: ([0-9.]+)%", proc.stdout)]
        assert len(accuracy) == 2 and accuracy[-1] > 50, (name, proc.stdout[-2000:])


def test_join_lets_ranks_with_uneven_steps_finish_with_horovods_semantics():
    steps = (2, 4, 6)
    results = _spawn_ranks("join_with_uneven_steps", 3, steps_by_rank=steps)
    for r, res in enumerate(results):
        for i in range(steps[r]):
            active = [q + 1 for q in range(3) if steps[q] > i]
            assert res["sum"][i] == sum(active) and res["big"][i] == (sum(active), sum(active))
            assert res["avg"][i] == pytest.approx(sum(active) / 3)  # Horovod: zeros, divided by size
            assert res["min"][i] == min(active) and res["max"][i] == max(active)
            assert res["prod"][i] == pytest.approx(float(torch.tensor(active).prod()))
        assert res["last"] == 2  # the longest shard joins last
    assert {res["last2"] for res in results} <= {1, 2} and len({res["last2"] for res in results}) == 1
    for res in results[1:]:  # round 2: rank 0 joined at once: allreduce and barrier go on without it
        assert res["sum2"] == 3.0


def test_gathers_and_broadcasts_while_a_rank_is_joined_raise_on_the_active_ranks_as_in_horovod():
    for kind in ("allgather", "broadcast", "alltoall", "reducescatter", "allgather_object", "broadcast_object"):
        joined, active = _spawn_ranks("collective_while_rank_zero_joined", 2, kind=kind)
        assert active["error"].startswith("MismatchError: ")
        assert f"{kind} is not supported while rank 0 joined (Horovod raises too)" in active["error"], kind
        # the joined rank went on serving: both join, and the ring works on
        assert joined["last"] == active["last"] == 1 and joined["after"] == active["after"] == 2.0


def test_join_replays_two_rank_swaps_and_in_place_reductions_of_the_active_rank():
    r0, r1 = _spawn_ranks("join_with_two_rank_swaps", 2, steps_by_rank=(1, 3))
    assert r0["new"] == [[3.0, 3.0]] and r0["in_place"] == [[2.0, 2.0]]
    # after rank 0 joined: its zeros for Sum, -inf for Max
    assert r1["new"] == [[3.0, 3.0], [2.0, 2.0], [2.0, 2.0]]
    assert r1["in_place"] == [[2.0, 2.0]] * 3
    assert r0["last"] == r1["last"] == 1


def test_join_with_distributed_optimizer_on_spark_matches_the_hand_computed_updates(spark):
    batches, lr = (2, 4), 0.1
    r0, r1 = run(hvd_fns.uneven_training, kwargs={"batches": batches, "lr": lr}, num_proc=2)
    assert r0["last"] == r1["last"] == 1
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = hvd_fns.uneven_batches(batches)
    states = []
    for step in range(max(batches)):
        grads = []
        for shard in data:
            if step < len(shard):
                model.zero_grad()
                x, y = shard[step]
                torch.nn.functional.mse_loss(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= lr * sum(g[i] for g in grads) / len(data)  # joined ranks add zeros
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    for key in ("weight", "bias"):
        torch.testing.assert_close(r0["weights"][key], states[batches[0] - 1][key], atol=1e-6, rtol=0)
        torch.testing.assert_close(r1["weights"][key], states[-1][key], atol=1e-6, rtol=0)


def test_broadcast_while_a_rank_is_joined_fails_the_run_on_spark_within_seconds(spark):
    from sparkring import RankFailedError

    with pytest.raises(RankFailedError) as info:
        run(hvd_fns.broadcast_from_a_joined_rank, num_proc=2, timeout=60)
    assert "broadcast is not supported while rank 0 joined (Horovod raises too)" in str(info.value)
