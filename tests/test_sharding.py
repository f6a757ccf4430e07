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


def _fsdp_equals_ddp(spark, tmp_path, num_proc):
    df = H.classification_df(spark, n=192)
    ddp = _fit(df, Store(str(tmp_path / "ddp")), numProc=num_proc, strategy="ddp")
    fsdp = _fit(df, Store(str(tmp_path / "fsdp")), numProc=num_proc, strategy="fsdp")
    a, b = _weights(ddp), _weights(fsdp)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0)
    assert [h["loss"] for h in fsdp.history] == pytest.approx([h["loss"] for h in ddp.history], abs=1e-5)
    # the fitted model is a plain module: it predicts and saves like a replicated fit's
    assert fsdp.transform(df.limit(8)).count() == 8


def test_fsdp_fit_gives_the_weights_of_a_ddp_fit_on_two_ranks(spark, tmp_path):
    _fsdp_equals_ddp(spark, tmp_path, 2)


def test_fsdp_fit_gives_the_weights_of_a_ddp_fit_on_three_ranks(spark_wide, tmp_path):
    _fsdp_equals_ddp(spark_wide, tmp_path, 3)


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
        assert abs(r["local_params"] - r["full_params"] / 3) <= r["full_params"] * 0.02
        assert r["state_bytes"] < budget, (r["state_bytes"], budget)
        assert r["losses"][-1] < r["losses"][0]
    for r in whole:
        assert r["state_bytes"] >= full * 0.99 > budget  # replicated: every rank keeps it all
    # the same data and initial weights: sharded training follows the replicated one
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
