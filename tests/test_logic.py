"""Pure decisions without Spark jobs or processes: the launch plan, version checks, exit
descriptions, compression, losses and metrics, Params. Part of the fast layer."""
import types

import pytest
import torch

from sparkring import ConfigurationError, SparkRingEstimator
from sparkring.collective.compression import Compression
from sparkring.runner import plan
from sparkring.runner.task.process import describe_exit
from sparkring.runner.versions import package_versions, skew
from sparkring.trainer.losses import check_loss, compute_loss, label_kind, metric_fns


def _session(master, **conf):
    conf = dict(conf, **{"spark.master": master})
    return types.SimpleNamespace(conf=types.SimpleNamespace(get=lambda k, d=None: conf.get(k, d)),
                                 sparkContext=types.SimpleNamespace(resources={}))


def test_the_plan_takes_every_slot_by_default_and_refuses_more_ranks_than_slots_naming_the_param():
    assert plan(_session("local[3]")).num_proc == 3
    with pytest.raises(ConfigurationError, match=r"num_proc=4 is larger than the 3 concurrent task slots.*"
                                                 r"lower num_proc to at most 3"):
        plan(_session("local[3]"), 4)


def test_the_plan_counts_slots_of_a_local_cluster_by_task_cpus():
    assert plan(_session("local-cluster[2,4,1024]", **{"spark.task.cpus": "2"})).num_proc == 4


def test_the_plan_refuses_unknown_backends_zero_ranks_and_nccl_without_gpus_before_any_job():
    with pytest.raises(ConfigurationError, match="backend='tcp' is not known"):
        plan(_session("local[2]"), 2, backend="tcp")
    with pytest.raises(ConfigurationError, match="num_proc=0: it must be at least 1"):
        plan(_session("local[2]"), 0)
    with pytest.raises(ConfigurationError, match="backend='nccl' needs GPUs"):
        plan(_session("local[2]"), 2, backend="nccl")


def test_the_plan_takes_its_attempts_from_the_task_retries_of_the_master():
    assert plan(_session("local[2]"), 2).attempts == 1
    assert plan(_session("local[2,3]"), 2).attempts == 3


def test_versions_differing_in_a_local_build_tag_agree_and_a_missing_package_is_named():
    driver = {"torch": "2.13.0+cpu", "pyarrow": "25.0.1", "python": "3.11.7"}
    assert skew(driver, {"a": {"torch": "2.13.0+cu128", "pyarrow": "25.0.0", "python": "3.11.9"}}) == []
    assert skew(driver, {"b": {"torch": "2.13.0", "python": "3.11.7"}}) == ["b: pyarrow missing (driver 25.0.1)"]
    assert skew(driver, {"c": {"torch": "2.13.0", "pyarrow": "25.0.1", "python": "3.12.1"}}) == [
        "c: python 3.12.1 (driver 3.11.7)"]


def test_this_process_reports_the_versions_it_runs():
    versions = package_versions()
    assert versions["torch"] == torch.__version__ and versions["python"].count(".") == 2


@pytest.mark.parametrize("code, words", [
    (0, "exited with code 0"), (3, "exited with code 3"), (None, "did not exit"),
    (-11, "was killed by signal 11 (SIGSEGV)"), (134, "was killed by signal 6 (SIGABRT)")])
def test_a_rank_exit_is_described_in_words(code, words):
    assert describe_exit(code) == words


def test_fp16_compression_halves_the_wire_and_restores_the_dtype():
    grad = torch.linspace(-3, 3, 101, dtype=torch.float32)
    wire, ctx = Compression.fp16.compress(grad)
    assert wire.dtype == torch.float16
    back = Compression.fp16.decompress(wire, ctx)
    assert back.dtype == torch.float32 and torch.allclose(back, grad, atol=2e-3)
    same, ctx = Compression.none.compress(grad)
    assert Compression.none.decompress(same, ctx) is grad
    ids = torch.arange(5)
    wire, ctx = Compression.fp16.compress(ids)
    assert wire.dtype == torch.int64  # integers are not compressed


def test_loss_names_decide_the_label_kind_and_unknown_ones_list_the_known():
    assert [label_kind(n) for n in ("cross_entropy", "bce_with_logits", "mse")] == ["class", "binary", "regression"]
    with pytest.raises(ValueError, match=r"loss='hinge' is not a known loss name; use one of \["):
        check_loss("hinge")
    out, y = torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
    weighted = compute_loss("cross_entropy", out, y, torch.tensor([1.0, 0.0]))
    assert torch.isclose(weighted, torch.nn.functional.cross_entropy(out[:1], y[:1]))


def test_metrics_by_name_or_callable_and_unknown_names_are_refused():
    fns = metric_fns(["accuracy", lambda out, y: out.sum()])
    assert list(fns)[0] == "accuracy"
    assert fns["accuracy"](torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1])).item() == 0.5
    with pytest.raises(ValueError, match="metric 'f1' is not known"):
        metric_fns("f1")


def test_params_keep_defaults_set_values_and_copies_independent():
    est = SparkRingEstimator(model=torch.nn.Linear(2, 2), batchSize=8)
    assert est.getBatchSize() == 8 and est.getEpochs() == est.getOrDefault("epochs")
    other = est.copy({est.batchSize: 32})
    assert other.getBatchSize() == 32 and est.getBatchSize() == 8
    assert "batchSize" in est.explainParams()


def test_the_readme_param_reference_is_the_param_table():
    import os
    import re

    from sparkring.estimator.params import PARAMS, reference_markdown

    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    block = re.search(r"(?s)<!-- params:begin -->\n(.*)\n<!-- params:end -->", readme)
    assert block is not None and block.group(1) == reference_markdown(), "run make docs"
    assert len(block.group(1).splitlines()) == len(PARAMS) + 2


def test_params_come_from_one_table_defaults_checks_and_signature():
    import inspect

    from sparkring.estimator.params import PARAMS

    est = SparkRingEstimator()
    assert all(est.getOrDefault(spec.name) == spec.default for spec in PARAMS)
    signature = inspect.signature(SparkRingEstimator)
    assert [p.name for p in signature.parameters.values()] == [spec.name for spec in PARAMS]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in signature.parameters.values())
    with pytest.raises(TypeError, match="SparkRingEstimator has no Param 'epoch'; did you mean 'epochs'"):
        SparkRingEstimator(epoch=3)
    with pytest.raises(TypeError, match="has no Param 'batch_size'; did you mean 'batchSize'"):
        est.setParams(batch_size=3)
