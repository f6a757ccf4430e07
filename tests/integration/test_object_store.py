"""Fits whose Store is an S3 bucket, served by moto's S3 API on loopback (tests/s3_server.py):
data, checkpoints (one file, and DCP's shards) and MLflow artifacts in the bucket; the server
stopped at the exact write of a checkpoint (a hook on the request, not a sleep) and started
again: the fit fails naming the Store and the checkpoint, nothing written before is lost, and the
same runId resumes from the last complete checkpoint to the uninterrupted weights."""
import est_helpers as H
import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from sparkring import SparkRingEstimator, SparkRingModel, Store
from sparkring.data import prepare
from sparkring.errors import RankFailedError, StoreError
from sparkring.trainer.checkpoints import latest

pytestmark = pytest.mark.slow


def _estimator(store, **kw):
    params = dict(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=3,
                  numProc=2, seed=3, store=store, verbose=0)
    params.update(kw)
    return SparkRingEstimator(**params)


@pytest.fixture(scope="module")
def uninterrupted(_spark_sessions, tmp_path_factory):
    spark = _spark_sessions.get("local")
    return _estimator(Store(str(tmp_path_factory.mktemp("local"))), runId="local").fit(H.classification_df(spark))


def _same_weights(a, b, atol):
    for name, value in b.getModel().state_dict().items():
        torch.testing.assert_close(a.getModel().state_dict()[name], value, atol=atol, rtol=0)


def test_a_checkpoint_upload_cut_short_on_s3_fails_the_fit_naming_the_store_and_a_resume_loses_nothing(
        spark, s3, uninterrupted, tmp_path, monkeypatch):
    df, store = H.classification_df(spark), s3.store("replicated")
    s3.stop_on(r"/checkpoints/epoch-00001\.pt$")  # the server goes away at the second epoch's checkpoint
    with pytest.raises(RankFailedError) as failed:
        _estimator(store, runId="cut").fit(df)
    assert s3.stopped_at.endswith("runs/cut/checkpoints/epoch-00001.pt")
    assert "could not be written to the Store s3://runs/replicated" in str(failed.value)
    assert "the checkpoint to go on at the start of epoch 3" in str(failed.value)
    s3.running()
    assert store.listdir(store.checkpoint_path("cut")) == ["epoch-00000.pt"]  # the one before is there, whole
    # resumed with the same runId; its model and metrics logged to MLflow, artifacts in the bucket
    import mlflow

    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    try:
        mlflow.set_experiment(experiment_id=mlflow.create_experiment("s3", artifact_location="s3://runs/mlflow"))
        resumed = _estimator(store, runId="cut", mlflowLogging="on").fit(df)
        run = mlflow.search_runs(output_format="list")[0]
        logged = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")  # read back from the bucket
    finally:
        mlflow.set_tracking_uri(before)
    assert [h["epoch"] for h in resumed.history] == [0, 1, 2]
    _same_weights(resumed, uninterrupted, atol=1e-5)
    artifacts = Store("s3://runs/mlflow", storage_options=s3.storage_options)
    found = artifacts.fs.get_file_info(pafs.FileSelector(artifacts.root, recursive=True))
    assert any(f.path.endswith("/MLmodel") for f in found)  # the model's files are in the bucket
    for name, value in resumed.getModel().state_dict().items():
        torch.testing.assert_close(logged.state_dict()[name], value, atol=0, rtol=0)
    # saved to the bucket and loaded back (the usual AWS variables name the endpoint), it predicts the same
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    resumed.write().save("s3://runs/models/cut")
    with pytest.raises(FileExistsError, match="overwrite"):
        resumed.write().save("s3://runs/models/cut")
    loaded = SparkRingModel.load("s3://runs/models/cut")
    assert store.listdir("runs/models/cut/metadata") == ["_SUCCESS", "part-00000"]
    assert [r.prediction for r in loaded.transform(df).collect()] == \
        [r.prediction for r in resumed.transform(df).collect()]


def test_a_sharded_checkpoint_cut_short_on_s3_never_becomes_the_latest(spark, s3, uninterrupted):
    df, store = H.classification_df(spark), s3.store("sharded")
    s3.stop_on(r"/checkpoints/epoch-00001\.dcp/")  # at the first shard of the second epoch's checkpoint
    with pytest.raises(RankFailedError, match=r"could not be written to the Store s3://runs/sharded"):
        _estimator(store, runId="cut", strategy="fsdp").fit(df)
    s3.running()
    assert latest(store, "cut").name == "epoch-00000.dcp"  # the cut one has no trainer state: not complete
    resumed = _estimator(store, runId="cut", strategy="fsdp").fit(df)
    assert [h["epoch"] for h in resumed.history] == [0, 1, 2]
    _same_weights(resumed, uninterrupted, atol=1e-4)


def test_a_store_out_of_reach_fails_the_fit_before_any_spark_job_naming_its_url(spark, s3):
    closed = Store("s3://runs/gone", storage_options={**s3.storage_options, "endpoint_url": "http://127.0.0.1:9"})
    tracker = spark.sparkContext.statusTracker()
    jobs = len(tracker.getJobIdsForGroup(None))
    with pytest.raises(StoreError, match=r"the store s3://runs/gone is not writable"):
        _estimator(closed).fit(H.classification_df(spark))
    assert len(tracker.getJobIdsForGroup(None)) == jobs


def test_parquet_files_on_s3_are_read_in_place_by_the_ranks_to_the_weights_of_local_files_or_copied(
        spark, s3, tmp_path, monkeypatch):
    # Spark here has no hadoop-aws connector to scan s3a:// itself: the same files are scanned
    # locally and the plan check answers with their copies' s3a:// URLs, as it would for a scan
    # of the bucket; the driver reads the footers and every rank its row groups from the bucket
    import os

    import s3fs

    from sparkring.data import in_place

    local = str(tmp_path / "scanned")
    H.classification_df(spark).repartition(2).write.parquet(local)
    df = spark.read.parquet(local)
    bucket = s3fs.S3FileSystem(**{k: v for k, v in s3.storage_options.items()})
    names = sorted(f for f in os.listdir(local) if f.endswith(".parquet"))
    for name in names:
        bucket.put(os.path.join(local, name), f"runs/scanned/{name}")
    on_local = _estimator(Store(str(tmp_path / "store")), epochs=1, runId="local").fit(df)
    monkeypatch.setattr(in_place, "scanned_files", lambda frame, columns: [f"s3a://runs/scanned/{n}" for n in names])
    store = s3.store("in-place")
    on_s3 = _estimator(store, epochs=1, runId="s3a", keepData=True).fit(df)
    _same_weights(on_s3, on_local, atol=1e-6)
    assert store.listdir(store.data_path("s3a")) == ["_sparkring_metadata.json"]  # no copy: the files themselves

    # a copy asked for (readInPlace=False) is made by the executors from the bucket's files into
    # the bucket: the rows and validation split of reading them in place
    columns = ["id", "features", "label"]
    copied = prepare(df, store, columns=columns, validation=0.25, seed=1)
    read = prepare(df, store, columns=columns, validation=0.25, seed=1, in_place=True)
    assert not copied.in_place and read.in_place and "train" in store.listdir(copied.data_dir)
    for split in ("train", "val"):
        ids = [np.sort(np.concatenate([b["id"].numpy() for b in ds.batches(64, shuffle=False, drop_last=False,
                                                                             split=split)])) for ds in (copied, read)]
        assert len(ids[0]) > 0
        np.testing.assert_array_equal(*ids)
