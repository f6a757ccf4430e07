"""GPU checks on the machine's real GPUs (``make gpu-check``): NCCL, gloo and MPI with CUDA
tensors, SyncBatchNorm in float16, the estimator with useGpu on and off, Horovod's pinning
pattern, ranks started after the Spark worker used CUDA, a language model sharded in bf16 on
the GPU that generates there. Skipped where torch sees no GPU.

With one GPU, the Spark-launched checks run one rank (two ranks on one GPU are refused for
NCCL) and the two-rank gloo checks run as plain processes sharing the GPU."""
import os
import subprocess

import est_helpers as H
import gpu_fns
import pytest
import rank_fns
import text_fns
import torch
from spawn import spawn_ranks
from waiting import wait_until

from sparkring import SparkRingEstimator, Store, run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device (make gpu-check on a GPU machine)")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
RANKS = min(2, GPUS)
TOLERANCE = 1e-4  # float32 reductions in another order on the GPU


def _shared_gpu(size):
    return {r: {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
                "SPARKRING_GPU": "0"} for r in range(size)}


def _assert_tour(results, backend):
    for r in results:
        assert r["backend"] == backend
        assert r["current_device"] == r["local_rank"] or backend == "gloo"
        assert all(set(where) == {"cuda"} for where in r["where"].values()), r["where"]
        assert max(r["diffs"].values()) < TOLERANCE, r["diffs"]


def test_nccl_collectives_equal_their_cpu_results_on_each_rank_own_gpu(spark_gpu):
    _assert_tour(run(gpu_fns.cuda_tour, num_proc=RANKS, use_gpu=True), "nccl")


def test_distributed_optimizer_on_nccl_ends_with_the_weights_of_one_process(spark_gpu):
    expected = rank_fns.train_reference(steps=4)
    for state in run(gpu_fns.train_on_gpu, kwargs={"steps": 4}, num_proc=RANKS, use_gpu=True):
        for key in expected:
            torch.testing.assert_close(state[key], expected[key], atol=1e-5, rtol=0)


def test_gloo_stages_cuda_tensors_through_host_memory_for_alltoall_and_adasum():
    _assert_tour(spawn_ranks("gpu_fns", "cuda_tour", 2, rank_env=_shared_gpu(2)), "gloo")


def test_mpi_moves_cuda_tensors_through_host_memory_adasum_included(spark_gpu):
    pytest.importorskip("mpi4py")
    from sparkring.runner._probe import mpi_library

    if "Open MPI" in (mpi_library() or ""):
        pytest.skip("mpi4py runs on Open MPI here; backend='mpi' runs on MPICH (refused before any job)")
    _assert_tour(run(gpu_fns.cuda_tour, num_proc=RANKS, backend="mpi", use_gpu=True), "mpi")


def test_sync_batch_norm_float16_on_gpu_matches_float32_batch_norm_of_the_whole_batch():
    results = spawn_ranks("gpu_fns", "sync_batch_norm_half", 2, rank_env=_shared_gpu(2),
                          shape=(32, 8, 56, 56), device="cuda")
    whole = results[0]["whole"].float()
    expected = torch.nn.functional.batch_norm(whole, None, None, training=True, eps=1e-5)
    got = torch.cat([r["out"] for r in results])
    assert torch.isfinite(got).all()
    assert torch.allclose(got, expected, atol=2e-2), (got - expected).abs().max()


def _gpu_memory_used_mib():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(v) for v in out.split())


def test_estimator_trains_and_transforms_with_use_gpu_on_and_off_and_frees_the_gpu(spark_gpu, tmp_path):
    df = H.classification_df(spark_gpu)
    before = _gpu_memory_used_mib()
    predictions = {}
    for use_gpu in (True, False):
        est = SparkRingEstimator(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=3,
                                 numProc=RANKS, seed=3, store=Store(str(tmp_path / f"gpu-{use_gpu}")), verbose=0,
                                 useGpu=use_gpu)
        model = est.fit(df)
        assert model.history[-1]["loss"] < model.history[0]["loss"]
        assert all(p.device.type == "cpu" for p in model.getModel().parameters())  # rank 0's weights, on CPU
        rows = model.transform(df).select("label", "prediction").collect()
        predictions[use_gpu] = sum(r.prediction == r.label for r in rows) / len(rows)
    assert min(predictions.values()) > 0.85, predictions
    # the ranks are gone and took their GPU memory with them (Spark's reused Python workers may
    # keep one CUDA context and a cached model each)
    assert wait_until(lambda: _gpu_memory_used_mib() - before < 2048, timeout=30, every=0.5)


def test_a_model_on_the_driver_gpu_trains_on_cpu_ranks(spark_gpu, tmp_path):
    net = H.mlp().cuda()
    est = SparkRingEstimator(model=net, optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=1,
                             numProc=2, seed=3, store=Store(str(tmp_path / "s")), verbose=0, useGpu=False)
    model = est.fit(H.classification_df(spark_gpu))
    assert len(model.history) == 1


def test_horovod_mnist_example_pins_each_rank_to_its_gpu_unchanged(spark_gpu):
    out = run(os.path.join(ROOT, "examples", "horovod_mnist.py"), args=["--epochs", "1", "--train-size", "512"],
              num_proc=RANKS, use_gpu=True)
    assert out == [0] * RANKS


def test_ranks_start_after_the_spark_worker_used_cuda(spark_gpu):
    # Spark reuses its Python workers: they have initialised CUDA when the ranks start from them
    touched = spark_gpu.sparkContext.parallelize(range(2), 2).mapPartitions(gpu_fns.touch_cuda).collect()
    assert touched == [True, True]
    results = run(rank_fns.gpu_view, num_proc=RANKS, use_gpu=True)
    assert all(r["spawned"] for r in results)
    assert [r["gpu"] for r in results] == [str(i) for i in range(RANKS)]


def test_a_causal_lm_trains_sharded_in_bf16_on_the_gpu_and_generates_there(spark_gpu, tmp_path):
    pytest.importorskip("transformers")
    tokenizer = text_fns.tokenizer()
    text = spark_gpu.createDataFrame(list(enumerate(text_fns.sentences(240))), ["id", "text"])
    fitted = SparkRingEstimator(
        model=text_fns.llama(tokenizer.get_vocab_size()), optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
        textCol="text", tokenizer=tokenizer, task="causal-lm", sequenceLength=32, batchSize=8, epochs=3,
        numProc=RANKS, strategy="fsdp", precision="bf16-mixed", activationCheckpointing="full", useGpu=True,
        store=Store(str(tmp_path / "lm")), verbose=0, seed=1).fit(text)
    assert fitted.history[-1]["loss"] < fitted.history[0]["loss"] * 0.8
    assert all(p.device.type == "cpu" for p in fitted.getModel().parameters())
    prompts = spark_gpu.createDataFrame([("the big cat",), ("the small dog",)], ["text"])
    generating = fitted.copy({fitted.getParam("inference"): "generate"})
    generated = [r.prediction for r in generating.transform(prompts).collect()]
    # trained text continues both prompts with a verb the sentences use
    assert all(g.split()[0] in ("sat", "ran") for g in generated), generated
