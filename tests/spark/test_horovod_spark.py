"""sparkring.spark as horovod.spark: each failure class Horovod's own Spark tests found, as a test
of the project's own (CI cannot fetch Horovod; conformance/make_horovod_spark_suite.py
runs Horovod's files themselves)."""
import csv
import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import sparkring as horovod
from sparkring.collective.elastic import ObjectState
from sparkring.errors import ConfigurationError
from sparkring.spark.common import util
from sparkring.spark.common.backend import SparkBackend
from sparkring.spark.common.store import FilesystemStore, HDFSStore, LocalStore, Store
from sparkring.spark.torch import TorchEstimator, TorchModel
from sparkring.spark.torch.losses import HorovodLoss

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HELPERS = os.path.join(ROOT, "tests", "helpers")


def minus(output, label, reduction=None):
    losses = label - output
    return losses if reduction == "none" else losses.mean()


def test_a_horovod_loss_weights_rows_through_reduction_none_and_takes_their_plain_mean():
    # Horovod's own figures (test_calculate_loss_with_sample_weight): (label - output) * weight, then the mean
    weights = torch.tensor([1.0, 6.0, 3.0])
    output, label = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([1.0, 2.0, 3.0])
    assert HorovodLoss(minus)(output, label, sample_weight=weights) == 5.0
    assert HorovodLoss(minus)(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([1.0, 2.0, 3.0])) == 1.0
    # a loss module: its reduction set to 'none' on a copy; the label (3,) reshaped to the output's (3, 1)
    module = torch.nn.MSELoss()
    got = HorovodLoss(module)(torch.zeros(3, 1), torch.tensor([1.0, 2.0, 3.0]), sample_weight=weights)
    assert got == pytest.approx((1 * 1 + 4 * 6 + 9 * 3) / 3) and module.reduction == "mean"


def test_torch_estimator_keywords_become_params_and_what_cannot_be_honoured_is_refused(tmp_path):
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(1352, 10))
    est = TorchEstimator(backend=SparkBackend(num_proc=3, start_timeout=45), store=Store.create(str(tmp_path)),
                         model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss=F.nll_loss,
                         input_shapes=[[-1, 1, 28, 28]], feature_cols=["features"], label_cols=["label"],
                         batch_size=16, epochs=2, random_seed=7, shuffle_buffer_size=100, reader_pool_type="process",
                         gradient_compression=horovod.collective.Compression.fp16, use_gpu=False)
    config = est.config()
    assert (config.num_proc, config.start_timeout, config.batch_size, config.seed) == (3, 45.0, 16, 7)
    assert (config.feature_columns, config.input_shapes, config.label_columns) == (["features"], [1, 28, 28], ["label"])
    assert (config.learning_rate_scaling, config.gradient_compression, config.use_gpu) == ("linear", "fp16", False)
    assert isinstance(est.getOrDefault("loss")[0], HorovodLoss)
    two_inputs = TorchEstimator(feature_cols=["a", "b"], input_shapes=[[2], [3]], label_cols=["y"])
    assert two_inputs.config().model_inputs == ["a", "b"] and two_inputs.config().input_shapes == [[2], [3]]
    with pytest.raises(ConfigurationError, match="data_module"):
        TorchEstimator(data_module=object)
    with pytest.raises(ConfigurationError, match="backend= or num_proc="):
        TorchEstimator(num_proc=2, backend=SparkBackend(num_proc=2))


def test_horovods_store_lays_out_runs_and_data_and_reads_and_writes_by_url(tmp_path):
    store = Store.create(str(tmp_path))
    assert type(store) is FilesystemStore and isinstance(LocalStore(str(tmp_path)), FilesystemStore)
    url = tmp_path.as_uri()
    assert store.get_checkpoint_path("run01") == f"{url}/runs/run01"
    assert store.get_train_data_path(2) == f"{url}/intermediate_train_data.2"
    assert store.get_logs_path("run01") == f"{url}/runs/run01/logs"
    assert not store.exists(store.get_checkpoint_path("run01"))
    store.write_text(f"{url}/runs/run01/checkpoints/epoch-00001.ckpt", "weights")
    assert store.exists(store.get_checkpoint_path("run01")) and store.read(
        f"{url}/runs/run01/checkpoints/epoch-00001.ckpt") == b"weights"
    assert store.get_checkpoints("run01") == [f"{url}/runs/run01/checkpoints/epoch-00001.ckpt"]
    assert store.checkpoint_path("run01") == str(tmp_path / "runs" / "run01" / "checkpoints")  # sparkring's, inside
    moved = Store.create(str(tmp_path), runs_path=str(tmp_path / "elsewhere"), save_runs=False)
    assert moved.run_path("r") == str(tmp_path / "elsewhere" / "r") and moved.get_checkpoint_path("r") is None
    assert type(Store.create("hdfs://namenode:8020/user/me")) is HDFSStore  # opened on first use: on paper here


def test_an_elastic_states_commits_is_the_scripts_own_once_assigned():
    state = ObjectState(commits=0, epoch=0)  # Horovod's test keeps a counter of its own by this name
    state.commits += 1
    state.save()
    state.commits += 5
    state.restore()
    assert state.commits == 1 and ObjectState(epoch=0).commits == 0


def elastic_fn(epochs):
    import sparkring.collective as hvd

    @hvd.elastic.run
    def train(state):
        state.rendezvous += 1
        for state.epoch in range(state.epoch, epochs):  # noqa: B020 - Horovod's own idiom
            print(f"rank {hvd.rank()} epoch {state.epoch}")
            state.commits += 1
            state.commit()
        return hvd.allgather(torch.tensor([hvd.rank(), state.epoch, state.commits, state.rendezvous])).tolist()

    hvd.init()
    return train(hvd.elastic.ObjectState(epoch=0, commits=0, rendezvous=0))


@pytest.mark.slow  # two launches
def test_horovod_spark_run_and_run_elastic_take_horovods_keywords_and_streams(spark):
    out, err = io.StringIO(), io.StringIO()

    def fn(x):
        print("hello from", x)
        return x + 1

    got = horovod.spark.run(fn, args=(1,), num_proc=2, start_timeout=60, extra_mpi_args="-x NCCL_DEBUG", nics=["eth0"],
                            stdout=out, stderr=err, verbose=2, prefix_output_with_timestamp=True, executable="python3")
    assert got == [2, 2]
    stamped = r"^\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4} \[[01]\] hello from 1$"
    assert re.search(stamped, out.getvalue(), re.M), out.getvalue()
    got = horovod.spark.run_elastic(elastic_fn, args=(3,), num_proc=2, min_num_proc=2, max_num_proc=2,
                                    start_timeout=60, elastic_timeout=60, reset_limit=1, verbose=0)
    assert got == [[0, 2, 3, 1, 1, 2, 3, 1]] * 2  # each rank's allgather: every rank's row


def xor_df(spark, copies=8):
    from pyspark.ml.feature import VectorAssembler

    rows = [(0, 0, 0.0, 0.1, 1), (0, 1, 1.0, 0.2, 0), (1, 0, 1.0, 0.3, 0), (1, 1, 0.0, 0.4, 0)] * copies
    raw = spark.createDataFrame(rows, "x1 int, x2 int, y float, weight float, val int")
    return VectorAssembler(inputCols=["x1", "x2"], outputCol="features").transform(raw)


class XOR(torch.nn.Module):
    def __init__(self, outputs=1):
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(2, 8), torch.nn.Linear(8, outputs)

    def forward(self, features):
        return torch.sigmoid(self.lin2(torch.tanh(self.lin1(features.float()))))


@pytest.mark.slow  # two fits
def test_a_torch_estimator_fit_weights_rows_steps_past_its_epoch_and_resumes_by_run_id(spark, tmp_path):
    torch.manual_seed(0)
    model = XOR()
    store = LocalStore(str(tmp_path))
    est = TorchEstimator(num_proc=2, store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         loss=F.binary_cross_entropy, input_shapes=[[2]], feature_cols=["features"], label_cols=["y"],
                         batch_size=4, epochs=2, random_seed=1, verbose=0, backward_passes_per_step=16,
                         sample_weight_col="weight", run_id="run01")
    df = xor_df(spark)
    fitted = est.fit(df)  # 4 steps an epoch per rank, fewer than backward_passes_per_step: one update an epoch
    assert isinstance(fitted, TorchModel) and [e["epoch"] for e in fitted.getHistory()] == [0, 1]
    assert store.exists(store.get_checkpoint_path("run01"))
    out = fitted.transform(df)
    assert dict(out.dtypes)["y__output"] == "float" and out.count() == df.count()
    assert torch.is_tensor(fitted.getModel()(torch.ones([1, 2], dtype=torch.int32)))
    assert est._load_checkpoint("run01") is not None  # a second fit with run_id resumes from there
    again = est.fit(df)
    assert again.getHistory() == fitted.getHistory()  # it went on from the last epoch: nothing left to train


def labelled_one(row):
    return {**row, "y": np.float32(1.0)}


def test_a_horovod_transformation_fn_changes_each_row_for_training_and_not_for_scoring():
    est = TorchEstimator(transformation_fn=labelled_one, feature_cols=["features"], label_cols=["y"])
    config = est.config()
    batch = {"features": np.arange(6.0).reshape(3, 2), "y": np.zeros(3, dtype=np.float32)}
    out = config.transform_fn(batch)
    assert out["y"].tolist() == [1.0, 1.0, 1.0] and out["features"].tolist() == batch["features"].tolist()
    assert config.transform_fn_inference(batch) == {}  # Horovod's TorchModel scores the rows as they are
    with pytest.raises(TypeError, match="not a dict"):
        TorchEstimator(transformation_fn=lambda row: None).config().transform_fn(batch)
    from sparkring.spark.lightning import TorchEstimator as LightningEstimator

    lightning = LightningEstimator(transformation_fn=labelled_one, transformation_removed_fields=["weight"],
                                   transformation_edit_fields=[("y", np.float32, (), False)])
    assert lightning.config().transform_fn(batch)["y"].tolist() == [1.0, 1.0, 1.0]


def logged_minibatch(log_path):
    def train_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights,
                        backward_passes_per_step, batch_idx):
        with open(log_path, "a") as log:
            log.write(f"{batch_idx} {backward_passes_per_step} {len(inputs)} {tuple(inputs[0].shape)} "
                      f"{labels[0].tolist()}\n")
        if batch_idx % backward_passes_per_step == 0:  # Horovod's own function's steps
            if batch_idx != 0:
                optimizer.step()
            optimizer.zero_grad()
        outputs, targets = transform_outputs(model(*inputs), labels)
        loss = loss_fn(outputs, targets, sample_weights) / backward_passes_per_step
        loss.backward()
        return outputs, loss
    return train_minibatch


@pytest.mark.slow  # a fit and a transform
def test_a_train_minibatch_fn_steps_through_the_rows_transformation_fn_returns_with_horovods_arguments(
        spark, tmp_path):
    torch.manual_seed(0)
    model, log_path = XOR(), str(tmp_path / "calls.txt")
    est = TorchEstimator(num_proc=2, store=LocalStore(str(tmp_path)), model=model, loss=F.binary_cross_entropy,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.5), input_shapes=[[2]],
                         feature_cols=["features"], label_cols=["y"], batch_size=4, epochs=3, verbose=0,
                         backward_passes_per_step=2, train_minibatch_fn=logged_minibatch(log_path),
                         transformation_fn=labelled_one)
    df = xor_df(spark)  # 32 rows, a quarter of them labelled 1: 4 batches of 4 an epoch on each of the 2 ranks
    fitted = est.fit(df)
    # trained towards the labels transformation_fn set, by the function's own optimizer steps; scored on the rows
    # as they are (trained on the DataFrame's labels, the scores would fall towards 0.25; without steps, ~0.5)
    scores = [row["y__output"] for row in fitted.transform(df).select("y__output").collect()]
    assert min(scores) > 0.8, scores
    with open(log_path) as log:
        calls = sorted(log.read().splitlines())
    # batch_idx 0-3, backward_passes_per_step, one input of 4 rows, labels all 1; 3 epochs on 2 ranks
    assert calls == sorted([f"{i} 2 1 (4, 2) [1.0, 1.0, 1.0, 1.0]" for i in range(4)] * 3 * 2)
    assert len(fitted.getHistory()) == 3 and fitted.getHistory()[-1]["loss"] < fitted.getHistory()[0]["loss"]
    with pytest.raises(ConfigurationError, match="train_minibatch_fn.*strategy"):
        est.copy({est.getParam("strategy"): "fsdp"}).fit(df)


@pytest.mark.slow  # a fit and a transform
def test_prepare_data_then_fit_on_parquet_trains_on_the_written_rows_and_a_hand_built_model_scores_vectors(
        spark, tmp_path):
    store = LocalStore(str(tmp_path))
    df = xor_df(spark, copies=4)
    model = XOR()
    est = TorchEstimator(num_proc=2, store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         loss=torch.nn.BCELoss(), input_shapes=[[2]], feature_cols=["features"], label_cols=["y"],
                         batch_size=2, epochs=1, verbose=0, validation="val")
    with util.prepare_data(2, store, df, label_columns=["y"], feature_columns=["features"], validation="val") as idx:
        assert store.is_parquet_dataset(store.get_train_data_path(idx))
        fitted = est.fit_on_parquet(dataset_idx=idx)
    assert "val_loss" in fitted.getHistory()[-1]
    two_wide = TorchModel(model=XOR(outputs=2), input_shapes=[[2]], feature_columns=["features"], label_columns=["y"],
                          _metadata=util._get_metadata(df))
    out = two_wide.setOutputCols(["y_scores"]).transform(df)
    assert dict(out.dtypes)["y_scores"] == "vector" and len(out.first()["y_scores"]) == 2


def run_horovod_spark_example(name, imports, epochs, tmp_path):
    """Run Horovod's example ``name`` (tests/horovod_examples/, its imports changed to ``imports`` and
    nothing else) on 2 ranks over the offline MNIST stand-in; its finished process."""
    sys.path.insert(0, HELPERS)
    from mnist_libsvm import write_mnist_libsvm

    script = os.path.join(ROOT, "tests", "horovod_examples", name)
    code = open(script).read().split("\n", 2)[2]  # below the two lines saying where it comes from
    assert [line.split("#")[0].strip() for line in code.splitlines() if "sparkring" in line] == imports
    write_mnist_libsvm(str(tmp_path / "mnist.bz2"), rows=2000)  # where the script looks before downloading
    seeded = "import runpy, sys, torch; torch.manual_seed(0); runpy.run_path(sys.argv.pop(1), run_name='__main__')"
    args = ["--num-proc", "2", "--epochs", str(epochs), "--batch-size", "32", "--data-dir", str(tmp_path),
            "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run([sys.executable, "-c", seeded, script, *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path,
                          env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def printed_accuracy(proc):
    return float(re.search(r"Test accuracy: ([0-9.]+)", proc.stdout).group(1))


@pytest.mark.slow  # a Spark application in a subprocess, ~30 s
def test_horovods_own_spark_mnist_example_trains_with_only_its_imports_changed(tmp_path):
    proc = run_horovod_spark_example("pytorch_spark_mnist.py", [
        "import sparkring.spark.torch as hvd", "from sparkring.spark.common.backend import SparkBackend",
        "from sparkring.spark.common.store import Store"], 2, tmp_path)
    assert printed_accuracy(proc) > 0.9, proc.stdout[-2000:]


@pytest.mark.slow  # a Spark application in a subprocess, ~40 s
def test_horovods_own_lightning_spark_mnist_example_trains_with_only_its_imports_changed(tmp_path):
    proc = run_horovod_spark_example("pytorch_lightning_spark_mnist.py", [
        "import sparkring.spark.lightning as hvd", "from sparkring.spark.lightning.estimator import MIN_PL_VERSION",
        "from sparkring.spark.common.backend import SparkBackend", "from sparkring.spark.common.store import Store"],
        3, tmp_path)
    # its Lightning 1.x callback ran and its own assertion held (on_epoch_end: 3 training + 3 validation epochs)
    ends = re.findall(r"Training ends:epcoh_end_counter=(\d+), train_epcoh_end_counter=(\d+), "
                      r"validation_epoch_end_counter=(\d+)", proc.stdout + proc.stderr)
    assert ends and set(ends) == {("6", "3", "3")}, (proc.stdout + proc.stderr)[-3000:]
    assert printed_accuracy(proc) > 0.9, proc.stdout[-2000:]


def test_lightning_trainer_args_with_a_param_become_it_and_lightning_callbacks_need_a_lightning_module(spark):
    from pytorch_lightning.callbacks import Callback

    from sparkring.spark.lightning import TorchEstimator as LightningEstimator

    est = LightningEstimator(model=XOR(), input_shapes=[[-1, 2]], feature_cols=["features"], label_cols=["y"],
                             trainer_args={"max_epochs": 3, "accumulate_grad_batches": 2, "num_sanity_val_steps": 0},
                             mp_start_method="spawn", terminate_on_nan=True)
    config = est.config()
    assert (config.epochs, config.backward_passes_per_step, config.lightning_batch) == (3, 2, "dict")
    assert est.getMpStartMethod() == "spawn" and est.setMpStartMethod("forkserver").getMpStartMethod() == "forkserver"
    assert est.getTerminateOnNan() and est.getTrainerArgs()["num_sanity_val_steps"] == 0
    # a plain module trains in sparkring's loop, which has no Trainer for a Lightning callback: refused before any job
    plain = LightningEstimator(model=XOR(), optimizer=torch.optim.SGD(XOR().parameters(), lr=0.1), loss=F.mse_loss,
                               input_shapes=[[-1, 2]], feature_cols=["features"], label_cols=["y"],
                               callbacks=[Callback()])
    jobs = spark.sparkContext.statusTracker().getJobIdsForGroup()
    with pytest.raises(ConfigurationError, match="Lightning Callback.*LightningModule"):
        plain.fit(xor_df(spark))
    assert spark.sparkContext.statusTracker().getJobIdsForGroup() == jobs


@pytest.mark.slow  # a fit
def test_a_lightning_module_written_for_horovod_trains_on_dict_batches(spark, tmp_path):
    from lightning_modules import DictXOR

    from sparkring.spark.lightning import TorchEstimator as LightningEstimator

    torch.manual_seed(0)
    est = LightningEstimator(num_proc=2, store=LocalStore(str(tmp_path)), model=DictXOR(), input_shapes=[[-1, 2]],
                             feature_cols=["features"], label_cols=["y"], validation="val", batch_size=2, epochs=2,
                             verbose=0, trainer_args={"num_sanity_val_steps": 0})
    fitted = est.fit(xor_df(spark, copies=4))
    assert est.config().learning_rate_scaling == "none"  # Horovod leaves a LightningModule's optimizer alone
    assert "val_loss" in fitted.getHistory()[-1] and "train_loss" in fitted.getHistory()[-1]


@pytest.mark.slow  # two fits
def test_lightnings_own_trainer_fits_a_horovod_module_with_its_callbacks_and_resumes_by_run_id(spark, tmp_path):
    from lightning_modules import EpochCounter, LegacyEpochEndXOR
    from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
    from pytorch_lightning.loggers import CSVLogger

    from sparkring.spark.lightning import TorchEstimator as LightningEstimator

    torch.manual_seed(0)
    store = LocalStore(str(tmp_path / "store"))
    best = ModelCheckpoint(dirpath=str(tmp_path / "unused"), monitor="val_loss", mode="min")
    est = LightningEstimator(num_proc=2, store=store, model=LegacyEpochEndXOR(), input_shapes=[[-1, 2]],
                             feature_cols=["features"], label_cols=["y"], validation="val", batch_size=2,
                             val_batch_size=1, epochs=3, verbose=0, run_id="lt01",
                             logger=CSVLogger(str(tmp_path / "csv")),
                             callbacks=[EpochCounter(3), LearningRateMonitor(logging_interval="epoch"), best],
                             trainer_args={"num_sanity_val_steps": 0})
    fitted = est.fit(xor_df(spark, copies=4))
    history = fitted.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2] and all(h["num_proc"] == 2 for h in history)
    # Lightning 1.x's validation_epoch_end got each of the epoch's validation steps (4 rows, 2 ranks, 1 a batch)
    assert [h["val_batches"] for h in history] == [2.0, 2.0, 2.0]
    assert history[-1]["avg_val_loss"] == pytest.approx(history[-1]["val_loss"], rel=0.5)
    # LearningRateMonitor logged the scheduler's halving rate into the user's logger, which rank 0's Trainer wrote
    # into the run's logs in the store (Horovod moves the logger's save_dir there)
    assert not os.path.exists(tmp_path / "csv")
    with open(os.path.join(store.logs_path("lt01"), "lightning_logs", "version_0", "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["adam_lr"]) for r in rows if r["adam_lr"]] == [0.05, 0.025, 0.0125]
    assert [float(r["avg_val_loss"]) for r in rows if r["avg_val_loss"]] == [h["avg_val_loss"] for h in history]
    # the best checkpoint (the user's ModelCheckpoint) is the returned model, as Horovod returns it
    kept = sorted(os.listdir(store.checkpoint_path("lt01", "lightning")))
    assert len(kept) == 2 and kept[-1] == "last.ckpt" and kept[0].startswith("epoch="), kept  # its top 1 and ours
    saved = torch.load(store.checkpoint_path("lt01", "lightning", kept[0]), map_location="cpu",
                       weights_only=False)["state_dict"]
    for name, value in fitted.getModel().state_dict().items():
        assert torch.equal(value, saved[name]), name
    # the same run id again: Lightning resumes from the run's checkpoint (3 epochs done), trains none more
    assert est._read_checkpoint("lt01") == store.checkpoint_path("lt01", "lightning", "last.ckpt")
    again = est.setEpochs(4).setCallbacks([EpochCounter(1)]).fit(xor_df(spark, copies=4))
    assert [h["epoch"] for h in again.getHistory()] == [3]


@pytest.mark.slow  # a fit
def test_lightning_1x_trainer_args_and_a_default_model_checkpoint_of_the_users_train_with_lightning_2(spark, tmp_path):
    from lightning_modules import DictXOR
    from pytorch_lightning.callbacks import ModelCheckpoint

    from sparkring.spark.lightning import TorchEstimator as LightningEstimator

    store = LocalStore(str(tmp_path / "store"))
    mine = ModelCheckpoint(dirpath=str(tmp_path / "mine"))  # configured as the run's own checkpoint is
    est = LightningEstimator(num_proc=2, store=store, model=DictXOR(), input_shapes=[[-1, 2]],
                             feature_cols=["features"], label_cols=["y"], validation="val", batch_size=2, epochs=3,
                             verbose=0, run_id="swa", callbacks=[mine],
                             trainer_args={"stochastic_weight_avg": True, "num_sanity_val_steps": 0})  # Lightning 1.x
    fitted = est.fit(xor_df(spark, copies=4))
    assert [h["epoch"] for h in fitted.getHistory()] == [0, 1, 2]
    kept = sorted(os.listdir(store.checkpoint_path("swa", "lightning")))
    assert kept == ["epoch=2-step=9.ckpt", "last.ckpt"], kept  # the user's checkpoint, and its last.ckpt to resume at
    saved = torch.load(store.checkpoint_path("swa", "lightning", kept[0]), map_location="cpu", weights_only=False)
    assert saved["callbacks"]["Lightning1SWA"]["latest_update_epoch"] == 2  # averaging ran, from epoch int(0.8 * 3)
    for name, value in fitted.getModel().state_dict().items():
        assert torch.equal(value, saved["state_dict"][name]), name
    # Lightning 1.x's terminate_on_nan (gone from Lightning 2's Trainer): the non-finite loss ends the fit, named
    from lightning_modules import NonFiniteXOR

    from sparkring.errors import TrainingError

    est = LightningEstimator(num_proc=2, store=store, model=NonFiniteXOR(), input_shapes=[[-1, 2]],
                             feature_cols=["features"], label_cols=["y"], batch_size=2, epochs=3, verbose=0,
                             terminate_on_nan=True)
    with pytest.raises(TrainingError, match=r"non-finite loss nan at epoch 1, step 0 on rank 1"):
        est.fit(xor_df(spark, copies=4))
