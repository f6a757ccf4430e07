"""User mistakes across run(), the CLI, the estimator and the data layer: each raises its own
error type with a message naming the problem and the fix, within 30 s, and leaves nothing
behind (no rank worker, no listening socket, nothing in the store; no Spark job where the
mistake can be seen before one)."""
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import est_helpers as H
import input_helpers as IH
import pytest
import rank_fns
import sharding_fns as S
import torch
from leftovers import footprint, settled_footprint
from paths import ROOT

from sparkring import ConfigurationError, DataError, RankFailedError, SparkRingEstimator, Store, StoreError, run
from sparkring.__main__ import main as cli_main
from sparkring.data import prepare

_LOCK = threading.Lock()


class WithLock(torch.nn.Module):
    """A model holding a lock: cannot be pickled."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 3))
        self.guard = _LOCK

    def forward(self, x):
        return self.body(x)


@dataclass
class Ctx:
    spark: Any
    store: Store
    tmp_path: Any
    capsys: Any


def _fit(ctx, df=None, **kw):
    params = dict(model=H.mlp(), optimizer=H.adam, loss="cross_entropy", batchSize=16, epochs=1, numProc=2,
                  store=ctx.store, verbose=0)
    params.update(kw)
    return SparkRingEstimator(**params).fit(df if df is not None else H.classification_df(ctx.spark, n=96))


def _closure_over_lock():
    lock = threading.Lock()
    return lambda: lock.locked()


def _read_only_store(ctx):
    path = ctx.tmp_path / "read-only"
    path.mkdir()
    os.chmod(path, 0o555)
    if os.geteuid() == 0:  # root writes through permission bits; an immutable directory stops it too
        subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    try:
        (path / "probe").write_text("x")
        os.remove(path / "probe")
        pytest.skip("cannot make a read-only directory here (root without chattr)")
    except OSError:
        pass
    try:
        return _fit(ctx, store=Store(str(path / "store")))
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        os.chmod(path, 0o755)


def _cli(ctx, *argv):
    code = cli_main(["run", *argv])
    err = ctx.capsys.readouterr().err
    if code != 0:
        raise SystemExit(f"exit {code}: {err.strip()}")
    return code


def _cli_process(*argv):
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, "-m", "sparkring", "run", *argv], capture_output=True, text=True,
                          env=env, timeout=60)
    if proc.returncode != 0:  # the error is the last line (Spark's own start-up lines come first)
        raise SystemExit(f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1]}")


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[Ctx], Any]
    error: type
    match: str
    before_any_job: bool = True
    compat: bool = False  # also run by make test-compat (the table's cross-section on Spark 3.5)


CASES = [
    # run()
    Case("run-fn-not-picklable", lambda c: run(_closure_over_lock(), num_proc=2), ConfigurationError,
         r"fn cannot be pickled .*: fn's closure variable 'lock' \(a lock\) fails with .*Create it inside"),
    Case("run-arg-not-picklable", lambda c: run(rank_fns.whoami, args=(open(os.devnull, "w"),), num_proc=2),
         ConfigurationError, r"args\[0\] cannot be pickled .*\(a TextIOWrapper\)"),
    Case("run-timeout-zero", lambda c: run(rank_fns.whoami, num_proc=2, timeout=0), ConfigurationError,
         r"timeout=0: it must be a positive number of seconds or None"),
    Case("run-start-timeout-negative", lambda c: run(rank_fns.whoami, num_proc=2, start_timeout=-1),
         ConfigurationError, r"start_timeout=-1: it must be a positive number of seconds"),
    Case("run-num-proc-zero", lambda c: run(rank_fns.whoami, num_proc=0), ConfigurationError,
         r"num_proc=0: it must be at least 1"),
    Case("run-num-proc-over-slots", lambda c: run(rank_fns.whoami, num_proc=3), ConfigurationError,
         r"num_proc=3 is larger than the 2 concurrent task slots .* lower num_proc to at most 2"),
    Case("run-unknown-backend", lambda c: run(rank_fns.whoami, num_proc=2, backend="tcp"), ConfigurationError,
         r"backend='tcp' is not known; use one of"),
    Case("run-nccl-without-gpus", lambda c: run(rank_fns.whoami, num_proc=2, backend="nccl", use_gpu=False),
         ConfigurationError, r"backend='nccl' needs GPUs: pass use_gpu=True"),
    Case("run-script-missing", lambda c: run(str(c.tmp_path / "nope.py"), num_proc=2), ConfigurationError,
         r"script '.*nope.py' cannot be read \(No such file or directory\): pass the path of a Python file"),
    Case("run-not-callable", lambda c: run(42, num_proc=2), ConfigurationError,
         r"fn must be a callable or a script path, got int"),
    Case("run-fn-raises", lambda c: run(rank_fns.fail_on_rank, args=(1,), num_proc=2, verbose=0), RankFailedError,
         r"(?s)rank 1 failed.*Traceback.*ValueError: boom on purpose in rank 1", before_any_job=False),
    # the CLI (exit status 2 and one line on stderr)
    Case("cli-script-missing", lambda c: _cli_process("-np", "2", str(c.tmp_path / "nope.py")), SystemExit,
         r"exit 2: sparkring: script '.*nope.py' cannot be read"),
    Case("cli-timeout-zero", lambda c: _cli(c, "-np", "2", "--timeout", "0", os.path.join(ROOT, "README.md")),
         SystemExit, r"exit 2: sparkring: --timeout=0: it must be a positive number of seconds"),
    Case("cli-np-over-slots", lambda c: _cli(c, "-np", "3", os.path.join(ROOT, "examples", "digits.py")),
         SystemExit, r"exit 2: sparkring: -np=3 is larger than the 2 concurrent task slots .* lower -np"),
    Case("cli-gpus-without-gpu-resources",
         lambda c: _cli_process("-np", "2", "--master", "local[2]", "--use-gpu", os.path.join(ROOT, "README.md")),
         SystemExit, r"exit 2: sparkring: --use-gpu=True in local mode but the driver has no GPUs: set "
                     r"spark.driver.resource.gpu.amount and spark.driver.resource.gpu.discoveryScript"),
    # the estimator
    Case("fit-features-missing", lambda c: _fit(c, featuresCol="nope"), ConfigurationError,
         r"featuresCol 'nope' is not a column"),
    Case("fit-label-missing", lambda c: _fit(c, labelCol="nope"), ConfigurationError,
         r"labelCol 'nope' is not a column"),
    Case("fit-unknown-loss", lambda c: _fit(c, loss="hinge"), ConfigurationError, r"loss='hinge' is not a known loss"),
    Case("fit-num-proc-over-slots", lambda c: _fit(c, numProc=3), ConfigurationError,
         r"numProc=3 is larger than the 2 concurrent task slots"),
    Case("fit-num-proc-zero", lambda c: _fit(c, numProc=0), ConfigurationError, r"numProc=0: it must be at least 1"),
    Case("fit-batch-size-zero", lambda c: _fit(c, batchSize=0), ConfigurationError,
         r"batchSize=0: it must be at least 1"),
    Case("fit-epochs-zero", lambda c: _fit(c, epochs=0), ConfigurationError, r"epochs=0"),
    Case("fit-validation-fraction", lambda c: _fit(c, validation=1.5), ConfigurationError, r"validation=1.5"),
    Case("fit-validation-column", lambda c: _fit(c, validation="label"), ConfigurationError,
         r"validation='label' must name a boolean column"),
    Case("fit-unknown-compression", lambda c: _fit(c, gradientCompression="int8"), ConfigurationError,
         r"gradientCompression='int8'"),
    Case("fit-early-stopping-metric", lambda c: _fit(c, earlyStopping={"patience": 1, "monitor": "val_auc"}),
         ConfigurationError, r"earlyStopping monitors 'val_auc'"),
    Case("fit-model-not-module", lambda c: _fit(c, model="not a module"), ConfigurationError,
         r"model='not a module' is not a torch.nn.Module or a zero-argument factory, so it must be a Hugging Face "
         r"checkpoint directory: not a module is not a Hugging Face checkpoint directory \(it does not exist\)"),
    Case("fit-model-not-picklable", lambda c: _fit(c, model=WithLock()), ConfigurationError,
         r"model cannot be pickled .*: model.guard \(a lock\) fails"),
    Case("fit-run-id-escapes", lambda c: _fit(c, runId="../escape"), ConfigurationError,
         r"runId='../escape' is not a plain name"),
    Case("fit-timeout-zero", lambda c: _fit(c, timeout=0), ConfigurationError,
         r"timeout=0: it must be a positive number of seconds"),
    Case("fit-store-unknown-scheme", lambda c: _fit(c, store=Store("foo://bucket/runs")), StoreError,
         r"store 'foo://bucket/runs': the scheme 'foo' cannot be opened .*s3fs for s3://"),
    Case("fit-store-read-only", _read_only_store, StoreError,
         r"the store .*read-only/store is not writable .* pass store=Store\("),
    Case("fit-non-integral-labels", lambda c: _fit(c, df=H.classification_df(c.spark, n=96).selectExpr(
        "id", "features", "label + 0.5 AS label")), DataError, r"labelCol 'label' has \d+ non-integral value",
         before_any_job=False, compat=True),
    Case("fit-negative-labels", lambda c: _fit(c, df=H.classification_df(c.spark, n=96).selectExpr(
        "id", "features", "IF(id % 7 = 3, -1.0, label) AS label")), DataError,
         r"labelCol 'label' has negative value -1; class indices start at 0", before_any_job=False),
    Case("fit-labels-out-of-range", lambda c: _fit(c, df=H.classification_df(c.spark, n=96).selectExpr(
        "id", "features", "IF(id % 5 = 0, 7.0, label) AS label")), RankFailedError,
         r"label value 7 is out of range for a model with 3 outputs", before_any_job=False),
    Case("fit-first-layer-too-narrow", lambda c: _fit(c, model=torch.nn.Sequential(
        torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))), DataError,
        r"first layer '0' is Linear\(in_features=32, out_features=16\) but the feature column\(s\) 'features' "
        r"\(8 values per row\) give it 8 values: build it as Linear\(8, 16\)", before_any_job=False),
    Case("fit-forward-raises", lambda c: _fit(c, model=H.ForwardFails()), RankFailedError,
         r"(?s)rank \d failed.*RuntimeError: forward fails on purpose.*sparkring: on rank \d, epoch 0, "
         r"training batch 0", before_any_job=False),
    # the data layer
    Case("data-string-column", lambda c: prepare(c.spark.createDataFrame([("a", 1.0)], "s string, y double"),
                                                 c.store, columns=["s", "y"]), DataError,
         r"column 's' has type string, which cannot become a tensor: index it first \(StringIndexer\)"),
    Case("data-input-missing", lambda c: _fit(c, modelInputs=["features", "nope"]), ConfigurationError,
         r"modelInputs names column 'nope' \(input 'nope'\), which is not in the DataFrame; it has \["),
    Case("data-binary-without-transform", lambda c: _fit(c, df=IH.images_df(c.spark, rows=64), modelInputs=["png"],
                                                           labelCol="label"), ConfigurationError,
         r"column 'png' \(input 'png'\) is binary: pass transformFn="),
    Case("fit-fsdp-on-mpi", lambda c: _fit(c, model=S.layer_stack(), strategy="fsdp", backend="mpi"),
         ConfigurationError, r"strategy='fsdp' needs torch.distributed collectives .*backend='gloo'"),
    Case("fit-hsdp-on-one-host", lambda c: _fit(c, model=S.layer_stack(), strategy="hsdp"), ConfigurationError,
         r"every rank runs on one host: there it is strategy='fsdp'"),
    Case("fit-cpu-offload-with-ddp", lambda c: _fit(c, cpuOffload=True), ConfigurationError,
         r"cpuOffload=True applies to a sharded model: set strategy='fsdp'"),
    Case("fit-fsdp-optimizer-instance", lambda c: _fit(c, strategy="fsdp", optimizer=torch.optim.SGD(
        H.mlp().parameters(), lr=0.1)), ConfigurationError, r"pass optimizer= as a factory"),
    Case("fit-fsdp-sparse-embeddings", lambda c: _fit(c, model=S.sparse_embeddings, strategy="fsdp"),
         ConfigurationError, r"module\(s\) \['0'\] use sparse=True"),
    Case("fit-fsdp-unit-of-two-dtypes", lambda c: _fit(c, model=S.mixed_dtypes, strategy="fsdp"), ConfigurationError,
         r"shards '0' as one unit, whose trainable parameters hold 2 dtypes \(.*torch.bfloat16.*\): FSDP2 refuses "
         r"that; build the model in one dtype .* or name each dtype's modules in fsdpWrap"),
    Case("fit-factory-fails-on-meta", lambda c: _fit(c, model=S.uses_meta_values, strategy="fsdp"),
         ConfigurationError, r"fails under torch.device\('meta'\).*initFn="),
    Case("fit-fsdp-gradient-compression", lambda c: _fit(c, model=S.layer_stack(), strategy="fsdp",
                                                         gradientCompression="fp16"),
         ConfigurationError, r"gradientCompression applies to strategy='ddp'"),
]


def _jobs(spark):
    return len(spark.sparkContext.statusTracker().getJobIdsForGroup(None))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.compat] if c.compat else [])
                                  for c in CASES])
def test_a_mistake_raises_its_own_error_naming_the_fix_and_leaves_nothing(spark, tmp_path, capsys, case):
    store = Store(str(tmp_path / "store"))
    ctx = Ctx(spark, store, tmp_path, capsys)
    before, jobs, started = footprint(), _jobs(spark), time.monotonic()
    with pytest.raises(case.error, match=case.match):
        case.call(ctx)
    assert time.monotonic() - started < 30
    if case.before_any_job:
        assert _jobs(spark) == jobs, "a Spark job ran before the mistake was reported"
    # the driver's own threads and sockets; Spark may start its Python daemons on a first job
    mine = ("driver_threads", "driver_listening", "workers")
    after = settled_footprint(before, timeout=10, fields=mine)
    assert after.workers == 0 and not after.grown(before, fields=mine), after.grown(before, fields=mine)
    stored = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "store").rglob("*") if p.is_file()) \
        if (tmp_path / "store").exists() else []
    if case.before_any_job:
        assert stored == [], f"left in the store: {stored}"
