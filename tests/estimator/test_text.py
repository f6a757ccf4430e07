"""Language models from a text column: tokenized on the executors, packed or padded, a Hugging
Face causal LM trained with its figures (tokens/s, perplexity) in history. Real Spark, a tiny
Llama built from its config and a BPE tokenizer trained on the test's own text."""
import pytest
import text_fns
import torch

from sparkring import SparkRingEstimator, Store
from sparkring.data.text import Encoder, TextLayout, tokenize
from sparkring.errors import ConfigurationError

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer():
    return text_fns.tokenizer()


def _text_df(spark, n=240):
    return spark.createDataFrame([(i, s) for i, s in enumerate(text_fns.sentences(n))], ["id", "text"])


def _estimator(tokenizer, store, **kw):
    params = dict(model=text_fns.llama(tokenizer.get_vocab_size() if tokenizer else 64), optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
                  textCol="text", tokenizer=tokenizer, task="causal-lm", sequenceLength=32, batchSize=8, epochs=2,
                  numProc=2, store=store, verbose=0, seed=1)
    params.update(kw)
    return SparkRingEstimator(**params)


def test_a_causal_lm_trains_on_a_text_column_with_tokens_per_second_and_perplexity(spark, tokenizer, tmp_path):
    fitted = _estimator(tokenizer, Store(str(tmp_path / "store"))).fit(_text_df(spark))
    first, last = fitted.history[0], fitted.history[-1]
    assert last["loss"] < first["loss"] * 0.8
    assert last["perplexity"] == pytest.approx(torch.tensor(last["loss"]).exp().item(), rel=1e-6)
    assert last["tokens_per_second"] > 0 and last["tokens_per_second_total"] == pytest.approx(
        2 * last["tokens_per_second"])
    assert last["tokens_cut"] == 0 and last["tokens"] > 240 * 8  # every document whole, closed by </s>
    assert type(fitted.getModel()).__name__ == "LlamaForCausalLM"


def test_packed_and_padded_rows_keep_the_same_real_tokens_and_cutting_is_counted(spark, tokenizer):
    df = _text_df(spark, n=60)
    encoder = Encoder(tokenizer)
    eos, pad = encoder.special_ids()
    made = {}
    for pack, length in ((True, 16), (False, 16), (False, 6)):
        tokenized, counts = tokenize(df, encoder, TextLayout("text", length, pack, eos, pad))
        rows = tokenized.collect()
        tokenized.unpersist()
        assert all(len(r.input_ids) == length for r in rows) and counts.rows == len(rows)
        made[(pack, length)] = counts
    assert made[(True, 16)].kept == made[(False, 16)].kept and made[(False, 16)].cut == 0
    assert made[(True, 16)].rows < made[(False, 16)].rows == 60  # packing fills the rows
    assert made[(False, 6)].kept + made[(False, 6)].cut == made[(False, 16)].kept  # nothing dropped silently


def test_text_mistakes_are_refused_before_any_spark_job(spark, tokenizer, tmp_path):
    df, store = _text_df(spark, n=8), Store(str(tmp_path / "store"))
    with pytest.raises(ConfigurationError, match=r"textCol='id' is bigint, not a string column"):
        _estimator(tokenizer, store, textCol="id").fit(df)
    with pytest.raises(ConfigurationError, match=r"textCol needs a tokenizer"):
        _estimator(None, store, model=text_fns.llama(64)).fit(df)
    with pytest.raises(ConfigurationError, match=r"textCol needs task="):
        _estimator(tokenizer, store, task=None).fit(df)
    with pytest.raises(ConfigurationError, match=r"sequenceLength=1: it must be at least 2"):
        _estimator(tokenizer, store, sequenceLength=1).fit(df)
