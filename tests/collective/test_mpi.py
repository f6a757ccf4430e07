"""backend="mpi": ranks under mpiexec joined into one MPI communicator, on real Spark."""
import os
import subprocess
import sys
import time

import hvd_fns
import psutil
import pytest
import rank_fns
import torch
from paths import ROOT
from waiting import wait_until

import sparkring.collective as sr
from sparkring import RankFailedError, run


def _assert_same(a, b, path="result"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, path
        assert torch.equal(a, b), f"{path}: {a} != {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _mpi_processes_left():
    left = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "sparkring.runner.task.worker" in cmd or ("mpiexec" in (p.info.get("name") or "") and "sparkring" in cmd):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append((p.pid, cmd[:120]))
            except psutil.NoSuchProcess:
                pass
    return left


@pytest.mark.compat
def test_mpi_ring_gives_the_same_results_as_gloo_for_every_collective(spark):
    on_mpi = run(rank_fns.collectives_tour, num_proc=2, backend="mpi")
    on_gloo = run(rank_fns.collectives_tour, num_proc=2, backend="gloo")
    assert [r["backend"] for r in on_mpi] == ["mpi", "mpi"]
    for m, g in zip(on_mpi, on_gloo):
        m.pop("backend"), g.pop("backend")
        _assert_same(m, g)


def test_mpi_reduces_every_dtype_and_runs_the_horovod_collectives(spark):
    r0, r1 = run(rank_fns.dtype_and_collective_tour, num_proc=2, backend="mpi")
    per_rank = ("alltoall", "reducescatter")
    _assert_same({k: v for k, v in r0.items() if k not in per_rank},  # the same values on every rank
                 {k: v for k, v in r1.items() if k not in per_rank})
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8):
        _assert_same(r0[f"sum_{dtype}"], (2 * torch.arange(5) + 1).to(dtype))
    _assert_same(r0["avg_half"], torch.tensor([1.5, 4.5], dtype=torch.float16))
    _assert_same(r0["prod"], torch.tensor([6.0, 12.0]))
    _assert_same(r0["bool_max"], torch.tensor([True, False, True]))
    _assert_same(r0["complex"], torch.tensor([3 + 6j, 9 - 3j], dtype=torch.complex64))
    _assert_same(r0["strided"], 2 * torch.arange(12.0).reshape(3, 4).t() + 1)
    _assert_same(r0["big"], torch.tensor([3.0, 3.0]))
    _assert_same(r0["grouped"], [torch.ones(2), torch.ones(3, dtype=torch.float64)])
    _assert_same(r0["alltoall"], torch.tensor([0, 1, 2, 100, 101, 102]))
    _assert_same(r1["alltoall"], torch.tensor([3, 4, 5, 103, 104, 105]))
    _assert_same(r0["reducescatter"], torch.tensor([0.0, 3.0, 6.0, 9.0]))
    _assert_same(r1["reducescatter"], torch.tensor([12.0, 15.0, 18.0, 21.0]))
    _assert_same(r0["params"], {"w": torch.ones(3), "step": torch.tensor(1)})
    _assert_same(r0["bcast_bf16"], torch.tensor([1.5, 2.5], dtype=torch.bfloat16))


def test_distributed_optimizer_on_mpi_ends_with_the_weights_of_one_process(spark):
    expected = rank_fns.train_reference(steps=4)
    for state in run(rank_fns.train_distributed, kwargs={"steps": 4}, num_proc=2, backend="mpi"):
        for k in expected:
            torch.testing.assert_close(state[k], expected[k], atol=1e-6, rtol=0)
    fp16 = run(rank_fns.train_distributed, kwargs={"steps": 4, "compression": "fp16"}, num_proc=2, backend="mpi")
    for k in expected:
        torch.testing.assert_close(fp16[0][k], expected[k], atol=5e-3, rtol=0)


def test_mpi_rank_exceeding_timeout_fails_the_run_with_its_stack(spark):
    from sparkring import RankTimeoutError

    started = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"exceeded timeout=8s") as info:
        run(rank_fns.hang_on_rank, args=(1,), num_proc=2, timeout=8, backend="mpi")
    assert time.monotonic() - started < 60
    text = str(info.value)
    assert "in hang_on_rank" in text[text.index("rank 1 "):]  # the stack of the rank itself, not mpiexec's
    wait_until(lambda: not _mpi_processes_left(), timeout=15)
    assert _mpi_processes_left() == []


def test_join_on_mpi_matches_join_on_gloo(spark):
    kwargs = {"batches": (2, 4), "lr": 0.1}
    on_mpi = run(hvd_fns.uneven_training, kwargs=kwargs, num_proc=2, backend="mpi")
    on_gloo = run(hvd_fns.uneven_training, kwargs=kwargs, num_proc=2, backend="gloo")
    for m, g in zip(on_mpi, on_gloo):
        assert m["last"] == g["last"] == 1
        for key in ("weight", "bias"):
            torch.testing.assert_close(m["weights"][key], g["weights"][key], atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_ranks_and_their_launchers_listen_on_loopback_only(spark, backend):
    # rank 0 hosts the rendezvous store: TCPStore alone would listen on every interface
    results = run(rank_fns.listening_addresses, num_proc=2, backend=backend)
    for r in results:
        assert r["addrs"] and set(r["addrs"]) == {"127.0.0.1"}, r["addrs"]
    if backend == "mpi":
        assert all(r["launcher"].startswith("mpiexec") for r in results)


def test_mpi_rank_failure_reaches_the_driver_and_no_launcher_or_rank_survives(spark):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run(rank_fns.fail_on_rank, args=(1,), num_proc=2, backend="mpi")
    assert info.value.rank == 1
    assert "ValueError: boom on purpose in rank 1" in info.value.remote_traceback
    assert time.monotonic() - started < 60
    wait_until(lambda: not _mpi_processes_left(), timeout=15)
    assert _mpi_processes_left() == []


def test_estimator_fit_on_mpi_learns_the_same_weights_as_on_gloo(spark, tmp_path):
    import est_helpers as H

    from sparkring import SparkRingEstimator, Store

    df = H.classification_df(spark)
    models = {}
    for backend in ("mpi", "gloo"):
        est = SparkRingEstimator(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=2,
                                 numProc=2, seed=3, store=Store(str(tmp_path / backend)), verbose=0,
                                 backend=backend)
        models[backend] = est.fit(df)
    assert models["mpi"].history[-1]["loss"] < models["mpi"].history[0]["loss"]
    mpi_state, gloo_state = (models[b].getModel().state_dict() for b in ("mpi", "gloo"))
    for k in gloo_state:
        torch.testing.assert_close(mpi_state[k], gloo_state[k], atol=1e-5, rtol=0)


def test_cli_runs_a_script_on_mpi():
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    script = os.path.join(ROOT, "examples", "hello_ring.py")
    proc = subprocess.run([sys.executable, "-m", "sparkring", "run", "-np", "2", "--master", "local[2]",
                           "--backend", "mpi", script, "--steps", "2"], capture_output=True, text=True,
                          env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on 2 ranks" in proc.stdout and "weights identical on all ranks: True" in proc.stdout


def test_mpi_is_reported_built_but_not_in_use_on_gloo():
    sr.init("gloo")
    try:
        assert sr.mpi_built() and not sr.mpi_threads_supported()
    finally:
        sr.shutdown()


def test_process_sets_work_on_mpi_as_on_gloo(spark):
    on_mpi = run(hvd_fns.process_sets_pair, num_proc=2, backend="mpi")
    on_gloo = run(hvd_fns.process_sets_pair, num_proc=2, backend="gloo")
    for rank, (m, g) in enumerate(zip(on_mpi, on_gloo)):
        assert m["set"] == (0, 1) and m["sum"].tolist() == [rank + 1.0] and m["bcast"].tolist() == [rank * 10]
        assert m["gather"].tolist() == [rank] and m["removed"] == [True, True] and m["global"].tolist() == [2.0]
        assert "outsider" in m
        _assert_same(m, g)


def test_mpi_runs_leave_dev_shm_as_they_found_it(spark):
    from sparkring.runner.task.mpi import mpi_shm_segments

    before = mpi_shm_segments()
    assert len(run(rank_fns.whoami, num_proc=2, backend="mpi")) == 2
    with pytest.raises(RankFailedError):
        run(rank_fns.fail_on_rank, args=(1,), num_proc=2, backend="mpi")
    wait_until(lambda: not mpi_shm_segments() - before, timeout=20)  # the failed run's other task cleans up
    assert mpi_shm_segments() - before == set()
