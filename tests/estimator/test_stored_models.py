"""Models that begin and end on storage: a factory calling from_pretrained, a checkpoint directory
(a path or an S3 URL), initialWeights, under every placement; what is refused before any Spark job.
Real Spark, tiny Llamas the tests save with save_pretrained."""
import pytest
import stored_fns
import text_fns
import torch

from sparkring import SparkRingEstimator, Store
from sparkring.errors import ConfigurationError

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer():
    return text_fns.tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("llama") / "llama"
    return path, stored_fns.save_llama(path, tokenizer.get_vocab_size(), tokenizer=tokenizer)


def _text_df(spark, n=64):
    return spark.createDataFrame([(i, s) for i, s in enumerate(text_fns.sentences(n))], ["id", "text"])


def _estimator(model, tokenizer, store, **kw):
    params = dict(model=model, optimizer=stored_fns.frozen, textCol="text", tokenizer=tokenizer, task="causal-lm",
                  sequenceLength=16, batchSize=8, epochs=1, numProc=2, store=store, verbose=0, seed=1)
    params.update(kw)
    return SparkRingEstimator(**params)


def _assert_same(fitted, expected):
    state = fitted.getModel().state_dict()
    assert set(expected) <= set(state)
    for name, value in expected.items():
        assert state[name].dtype == value.dtype, name
        torch.testing.assert_close(state[name], value, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("placement", [dict(strategy="ddp"), dict(strategy="fsdp"), dict(tensorParallel=2)],
                         ids=["ddp", "fsdp", "tp2"])
def test_a_from_pretrained_factory_starts_every_placement_from_the_checkpoint(
        spark, checkpoint, tokenizer, tmp_path, placement):
    path, expected = checkpoint
    fitted = _estimator(stored_fns.from_pretrained(path), tokenizer, Store(str(tmp_path / "store")),
                        **placement).fit(_text_df(spark))
    _assert_same(fitted, expected)


def test_a_checkpoint_directory_is_a_model(spark, checkpoint, tokenizer, tmp_path):
    path, expected = checkpoint
    fitted = _estimator(str(path), tokenizer, Store(str(tmp_path / "store")), strategy="fsdp").fit(_text_df(spark))
    _assert_same(fitted, expected)
    assert type(fitted.getModel()).__name__ == "LlamaForCausalLM"
