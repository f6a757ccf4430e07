"""The estimator's Params: one table gives the defaults, checks, signature and reference page (fast layer)."""
import pytest
import torch

from sparkring import SparkRingEstimator
from sparkring.errors import ConfigurationError
from sparkring.estimator.params import PARAMS


def test_params_keep_defaults_set_values_and_copies_independent():
    est = SparkRingEstimator(model=torch.nn.Linear(2, 2), batchSize=8)
    assert est.getBatchSize() == 8 and est.getEpochs() == est.getOrDefault("epochs")
    other = est.copy({est.batchSize: 32})
    assert other.getBatchSize() == 32 and est.getBatchSize() == 8
    assert "batchSize" in est.explainParams()


def test_the_param_reference_page_is_the_param_table():
    import os
    import re

    from paths import ROOT

    from sparkring.estimator.params import PARAMS, reference_markdown

    page = open(os.path.join(ROOT, "docs", "params.md")).read()
    block = re.search(r"(?s)<!-- params:begin -->\n(.*)\n<!-- params:end -->", page)
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


def test_every_param_is_one_typed_field_of_the_config_and_reads_back_as_set():
    import dataclasses

    from sparkring.estimator.config import EstimatorConfig

    assert [f.name for f in dataclasses.fields(EstimatorConfig)] == [spec.attr for spec in PARAMS]
    config = SparkRingEstimator(batchSize=8, tensorParallel=2, pipelineParallel=2, labelCol=["a", "b"],
                                strategy="fsdp", precision="bf16-mixed").config()
    assert config.batch_size == 8 and config.label_columns == ["a", "b"] and config.prediction_columns == [
        "a_prediction", "b_prediction"]
    assert config.model_parallel.group_size == 4 and config.model_parallel.data_size(world=8) == 2
    assert config.sharding.sharded and config.sharding.bf16_compute and not config.elastic


def test_a_value_outside_a_params_choices_is_refused_when_the_config_is_built():
    with pytest.raises(ConfigurationError, match="strategy='zero': use one of 'ddp', 'fsdp', 'hsdp'"):
        SparkRingEstimator(strategy="zero").config()
