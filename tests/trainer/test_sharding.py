"""Sharded training (strategy="fsdp", FSDP2): the same weights as replicated training, sharded
checkpoints that resume at another number of ranks, each rank keeping its share of the training
state, and device_mesh() for run() users. Real Spark, real Parquet, real processes."""
import est_helpers as H
import pytest
import sharding_fns as S
import torch

from sparkring import SparkRingEstimator, Store, run


def _fit(df, store, **kw):
    params = dict(model=S.layer_stack(), optimizer=S.adam, loss="cross_entropy", batchSize=16, epochs=2,
                  store=store, verbose=0, seed=3)
    params.update(kw)
    return SparkRingEstimator(**params).fit(df)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.getModel().state_dict().items()}


def _sharded_equals_ddp(spark, tmp_path, num_proc, strategy="fsdp", sharded_kw=None, **kw):
    df = H.classification_df(spark, n=192)
    # one store: both fits read the same prepared Parquet (on a cluster a DataFrame's row order
    # can differ between two materializations)
    store = Store(str(tmp_path / "store"))
    ddp = _fit(df, store, numProc=num_proc, strategy="ddp", runId="ddp", keepData=True, **kw)
    fsdp = _fit(df, store, numProc=num_proc, strategy=strategy, runId=strategy, **kw, **(sharded_kw or {}))
    _same_training(ddp, fsdp)
    # the fitted model is a plain module: it predicts and saves like a replicated fit's
    assert fsdp.transform(df.limit(8)).count() == 8
    return ddp, fsdp


def _same_training(ddp, fsdp):
    a, b = _weights(ddp), _weights(fsdp)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0)
    assert [h["loss"] for h in fsdp.history] == pytest.approx([h["loss"] for h in ddp.history], abs=1e-5)


def test_fsdp_fit_with_cpu_offload_gives_the_weights_of_a_ddp_fit_on_two_ranks(spark, tmp_path):
    # on a CPU rank the offloaded shards stay where they are: this runs FSDP2's offload policy
    # (the optimizer stepping on host-memory shards) and checks it trains the same weights
    df = H.classification_df(spark, n=192)
    ddp = _fit(df, Store(str(tmp_path / "ddp")), numProc=2, strategy="ddp")
    offloaded = _fit(df, Store(str(tmp_path / "fsdp")), numProc=2, strategy="fsdp", cpuOffload=True)
    _same_training(ddp, offloaded)


def test_fsdp_fit_on_three_ranks_trains_ddps_weights_keeping_a_third_of_the_state_per_rank(spark_wide, tmp_path):
    model = S.layer_stack(layers=8)
    ddp, fsdp = _sharded_equals_ddp(spark_wide, tmp_path, 3, model=model)
    built = model()
    params = sum(p.numel() for p in built.parameters())
    largest_unit = max(sum(p.numel() for p in m.parameters()) for m in built.children()) * 4
    full = params * 4 * 4      # float32 parameters, gradients and Adam's two moments
    budget = full / 3          # what one rank may keep: the full training state is 3x it
    for h in fsdp.history:
        # parameters + optimizer state, the largest rank's; plus the one layer FSDP2 gathers at a time
        assert h["state_bytes"] + largest_unit < budget, (h["state_bytes"], largest_unit, budget)
        assert h["state_bytes"] + h["grad_bytes"] <= full / 3 * 1.1  # ~1/3 of everything, padding aside
    for h in ddp.history:
        assert h["state_bytes"] >= params * 4 * 3 > budget  # replicated: every rank keeps it all


def test_hsdp_fit_of_two_ranks_per_task_on_two_hosts_trains_ddps_weights_sharding_within_each_host(
        spark_hosts, tmp_path):
    # ddp: four tasks of one rank; hsdp: two tasks of two ranks, one task per host (the world's
    # layout, hosts x local ranks, comes from the tasks' places)
    ddp, hsdp = _sharded_equals_ddp(spark_hosts, tmp_path, 4, strategy="hsdp", sharded_kw={"ranksPerTask": 2})
    # two ranks per host: each keeps half of the state, the other host a replica of it
    for d, h in zip(ddp.history, hsdp.history):
        assert h["state_bytes"] == pytest.approx(d["state_bytes"] / 2, rel=0.1)


def test_hsdp_on_two_hosts_starts_from_a_pretrained_checkpoint_and_each_rank_writes_its_file(spark_hosts, tmp_path):
    pytest.importorskip("transformers")
    import stored_fns
    import text_fns

    tok = text_fns.tokenizer()
    expected = stored_fns.save_llama(tmp_path / "llama", tok.get_vocab_size(), tokenizer=tok)
    df = spark_hosts.createDataFrame([(s,) for s in text_fns.sentences(64)], ["text"])
    fitted = SparkRingEstimator(model=stored_fns.from_pretrained(tmp_path / "llama"), optimizer=stored_fns.frozen,
                                textCol="text", tokenizer=tok, task="causal-lm", sequenceLength=16, batchSize=8,
                                epochs=1, numProc=4, ranksPerTask=2, strategy="hsdp",
                                store=Store(str(tmp_path / "store")), verbose=0).fit(df)
    state = fitted.getModel().state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, atol=0, rtol=0, msg=name)
    written = sorted(p.name for p in (tmp_path / "store").rglob("model-*.safetensors"))
    assert written == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]


def test_a_sharded_checkpoint_resumes_at_another_number_of_ranks(spark_wide, tmp_path):
    df = H.classification_df(spark_wide, n=192)
    store = Store(str(tmp_path / "store"))
    first = _fit(df, store, numProc=3, strategy="fsdp", epochs=1, runId="grow-shrink")
    assert [h["epoch"] for h in first.history] == [0]
    shrunk = _fit(df, store, numProc=2, strategy="fsdp", epochs=2, runId="grow-shrink")  # 3 -> 2 ranks
    assert [h["epoch"] for h in shrunk.history] == [0, 1]
    grown = _fit(df, store, numProc=3, strategy="fsdp", epochs=3, runId="grow-shrink")  # 2 -> 3 ranks
    assert [h["epoch"] for h in grown.history] == [0, 1, 2]
    assert grown.history[:2] == shrunk.history
    saved = sorted(p.name for p in (tmp_path / "store").rglob("epoch-*.dcp"))
    assert saved == ["epoch-00001.dcp", "epoch-00002.dcp"]  # the two newest, each with its shards
    assert len(list((tmp_path / "store").rglob("epoch-00002.dcp/*.distcp"))) == 3
    # a checkpoint cut short (no trainer state: not every rank's shards were known written)
    # falls back to the one before: epoch 2 runs again, once in the history
    marker, = (tmp_path / "store").rglob("epoch-00002.dcp/trainer.pt")
    marker.unlink()
    again = _fit(df, store, numProc=2, strategy="fsdp", epochs=3, runId="grow-shrink")
    assert [h["epoch"] for h in again.history] == [0, 1, 2] and again.history[:2] == shrunk.history
    assert marker.exists()


def test_each_rank_keeps_a_third_of_the_training_state_with_device_mesh_in_run(spark_wide):
    sharded = run(S.sharded_training_in_run, args=(True,), num_proc=3, verbose=0)
    whole = run(S.sharded_training_in_run, args=(False,), num_proc=3, verbose=0)
    full = sharded[0]["full_state_bytes"]  # parameters, gradients and Adam's two moments, float32
    budget = full / 2.5                    # what one rank may keep: the full state is over 2.5x it
    for r in sharded:
        assert r["mesh"] == "[0, 1, 2]"
        # ranks of one host: FSDP2's exchanges went through the shared-memory ring, every step
        routed, gathers, scatters = r["shared_memory"]
        assert routed and gathers >= 3 * 5 and scatters >= 3 * 5, r["shared_memory"]
        assert abs(r["local_params"] - r["full_params"] / 3) <= r["full_params"] * 0.02
        assert r["state_bytes"] < budget, (r["state_bytes"], budget)
        assert r["losses"][-1] < r["losses"][0]
    for r in whole:
        assert r["state_bytes"] >= full * 0.99 > budget  # replicated: every rank keeps it all
    # the same data and initial weights: sharded training (exchanging shards through shared
    # memory) follows the replicated one
    for s, w in zip(sharded, whole):
        assert s["losses"] == pytest.approx(w["losses"], abs=1e-5)


def test_hybrid_device_mesh_shards_within_a_host_and_replicates_across_hosts():
    from spawn import spawn_ranks

    places = {r: {"SPARKRING_CROSS_RANK": str(r // 2), "SPARKRING_CROSS_SIZE": "2", "SPARKRING_LOCAL_RANK": str(r % 2),
                  "SPARKRING_LOCAL_SIZE": "2", "SPARKRING_HOST_ID": f"host-{r // 2}"} for r in range(4)}
    results = spawn_ranks("sharding_fns", "hybrid_sharded_training", 4, timeout=120, rank_env=places)
    expected = S.hybrid_reference()
    for r in results:
        assert r["mesh"] == [[0, 1], [2, 3]] and r["names"] == ("replicate", "shard")
        assert r["local"] * 2 == pytest.approx(r["total"], rel=0.05)  # half of it: the host's share
    weights = results[0]["weights"]
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, atol=1e-5, rtol=0)


def test_asynchronous_checkpoints_train_the_same_weights_and_resume(spark, tmp_path):
    df = H.classification_df(spark, n=128)
    sync = _fit(df, Store(str(tmp_path / "sync")), numProc=2, strategy="fsdp", epochs=3)
    store = Store(str(tmp_path / "async"))
    first = _fit(df, store, numProc=2, strategy="fsdp", epochs=2, runId="bg", asyncCheckpoint=True)
    # the last checkpoint was completed at the end of the fit: a later fit resumes after it
    resumed = _fit(df, store, numProc=2, strategy="fsdp", epochs=3, runId="bg", asyncCheckpoint=True)
    assert [h["epoch"] for h in resumed.history] == [0, 1, 2] and resumed.history[:2] == first.history
    a, b = _weights(sync), _weights(resumed)
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0)


def test_a_block_of_two_dtypes_trains_sharded_once_each_dtype_is_a_unit_of_its_own(spark, tmp_path):
    # as a bfloat16 Hugging Face model that keeps some modules in float32: the fit without fsdpWrap is
    # refused before any job (tests/integration/test_bad_input.py); with it, each Linear is a unit
    df = H.classification_df(spark, n=192)
    store = Store(str(tmp_path / "store"))
    ddp = _fit(df, store, model=S.mixed_dtypes, numProc=2, strategy="ddp", runId="ddp", keepData=True)
    fsdp = _fit(df, store, model=S.mixed_dtypes, numProc=2, strategy="fsdp", fsdpWrap=["Linear"], runId="fsdp")
    weights = _weights(fsdp)
    assert {k: v.dtype for k, v in weights.items()} == {
        "0.kept.weight": torch.float32, "0.kept.bias": torch.float32,
        "0.body.weight": torch.bfloat16, "0.body.bias": torch.bfloat16}
    for key, value in _weights(ddp).items():
        torch.testing.assert_close(weights[key], value, atol=1e-2 if value.dtype == torch.bfloat16 else 1e-5, rtol=0)
    assert fsdp.history[-1]["loss"] < fsdp.history[0]["loss"]
