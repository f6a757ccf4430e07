"""Language models from a text column: tokenized on the executors, packed or padded, a Hugging
Face causal LM trained with its figures (tokens/s, perplexity) in history. Real Spark, a tiny
Llama built from its config and a BPE tokenizer trained on the test's own text."""
import contextlib
import io
import math
import re

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
    params = dict(model=text_fns.llama(tokenizer.get_vocab_size() if tokenizer else 64),
                  optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
                  textCol="text", tokenizer=tokenizer, task="causal-lm", sequenceLength=32, batchSize=8, epochs=2,
                  numProc=2, store=store, verbose=0, seed=1)
    params.update(kw)
    return SparkRingEstimator(**params)


@pytest.fixture(scope="module")
def fitted_lm(_spark_sessions, tokenizer, tmp_path_factory):
    """One causal LM trained on the sentences, every transform test reads it."""
    spark = _spark_sessions.get("local")
    store = Store(str(tmp_path_factory.mktemp("lm")))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the epoch lines (verbose=1)
        fitted = _estimator(tokenizer, store, epochs=3, runId="lm", verbose=1, peakFlops=1e9).fit(_text_df(spark))
    fitted.epoch_lines = [line for line in printed.getvalue().splitlines() if line.startswith("epoch ")]
    return fitted


def test_a_causal_lm_trains_on_a_text_column_with_tokens_per_second_and_perplexity(fitted_lm):
    fitted = fitted_lm
    first, last = fitted.history[0], fitted.history[-1]
    assert last["loss"] < first["loss"] * 0.8
    assert last["perplexity"] == pytest.approx(torch.tensor(last["loss"]).exp().item(), rel=1e-6)
    assert last["tokens_per_second"] > 0 and last["tokens_per_second_total"] == pytest.approx(
        2 * last["tokens_per_second"])
    assert last["tokens_cut"] == 0 and last["tokens"] > 240 * 8  # every document whole, closed by </s>
    # the live epoch line shows rank 0's tokens/s, the figure history keeps
    assert len(fitted.epoch_lines) == 3
    line = re.search(r"perplexity=([\d.]+)  ([\d,]+) tokens/s \(MFU ([\d.]+)%\), ", fitted.epoch_lines[-1])
    assert float(line.group(1)) == pytest.approx(last["perplexity"], abs=0.01)
    assert float(line.group(2).replace(",", "")) == pytest.approx(last["tokens_per_second"], abs=1)
    # MFU: 6 x parameters x tokens/s over the peak given (1 GFLOP/s)
    assert last["mfu"] == pytest.approx(6 * sum(p.numel() for p in fitted.getModel().parameters())
                                        * last["tokens_per_second"] / 1e9)
    assert float(line.group(3)) == pytest.approx(100 * last["mfu"], abs=0.1)
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
    with pytest.raises(ConfigurationError, match=r"task='causal-lm' needs a language-model head; "
                                                 r"LlamaForSequenceClassification classifies"):
        _estimator(tokenizer, store, model=text_fns.llama_classifier(64, 0)).fit(df)


def test_transform_generates_embeds_and_scores_text_and_the_tokenizer_survives_save_and_load(
        spark, fitted_lm, tmp_path):
    session = spark
    prompts = session.createDataFrame([("the big cat",), ("the small dog",), ("zzz unknown",)], ["text"])
    generated = [r.prediction for r in fitted_lm.copy({fitted_lm.getParam("inference"): "generate"})
                 .transform(prompts).collect()]
    # trained text continues "the big cat" with a verb the sentences use
    assert generated[0].split()[0] in ("sat", "ran") and generated[1].split()[0] in ("sat", "ran"), generated
    embedded = fitted_lm.copy({fitted_lm.getParam("inference"): "embed"}).transform(prompts).collect()
    assert all(len(r.prediction) == 64 for r in embedded)  # the hidden size
    scored = fitted_lm.copy({fitted_lm.getParam("inference"): "score"}).transform(
        session.createDataFrame([(text_fns.sentences(1, seed=9)[0],), ("mat the under blue ran",)], ["text"])
    ).collect()
    trained, shuffled = (r.prediction for r in scored)
    assert 1 <= trained.perplexity < shuffled.perplexity  # trained word order scores better than a shuffle
    fitted_lm.write().overwrite().save(str(tmp_path / "lm"))
    from sparkring import SparkRingModel

    loaded = SparkRingModel.load(str(tmp_path / "lm"))
    again = loaded.copy({loaded.getParam("inference"): "generate"}).transform(prompts).collect()
    assert [r.prediction for r in again] == generated


def test_transform_ships_the_model_once_and_again_when_its_weights_change(spark, fitted_lm):
    import copy

    from sparkring.estimator.shipping import Shipments

    net = copy.deepcopy(fitted_lm.getModel())
    shipments = Shipments()
    first = shipments.ship(spark, net)
    assert shipments.ship(spark, net) is first  # unchanged weights: the executors keep their copy
    generating = fitted_lm.copy({fitted_lm.getParam("model"): net, fitted_lm.getParam("inference"): "generate"})
    prompts = spark.createDataFrame([("the big cat",), ("the small dog",)], ["text"])
    before = [r.prediction for r in generating.transform(prompts).collect()]
    assert [r.prediction for r in generating.transform(prompts).collect()] == before
    with torch.no_grad():
        net.lm_head.weight.neg_()  # the least likely token comes first now
    assert shipments.ship(spark, net) is not first
    after = [r.prediction for r in generating.transform(prompts).collect()]
    assert after != before
    fresh = fitted_lm.copy({fitted_lm.getParam("model"): copy.deepcopy(net),
                            fitted_lm.getParam("inference"): "generate"})
    assert [r.prediction for r in fresh.transform(prompts).collect()] == after


def test_the_tokenizer_is_deserialized_once_per_python_worker_not_once_per_task(spark, fitted_lm, tokenizer, tmp_path):
    unpickled = tmp_path / "unpickled"
    counted = text_fns.CountedTokenizer(tokenizer, str(unpickled))
    generating = fitted_lm.copy({fitted_lm.getParam("tokenizer"): counted, fitted_lm.getParam("inference"): "generate"})
    prompts = spark.createDataFrame([(s,) for s in text_fns.sentences(12, seed=4)], ["text"]).repartition(6)
    first = [r.prediction for r in generating.transform(prompts).collect()]
    assert [r.prediction for r in generating.transform(prompts).collect()] == first  # 12 tasks in all
    workers = unpickled.read_text().split()
    # each worker once (how many idle workers PySpark's pool holds depends on the jobs before): fewer than the tasks
    assert 1 <= len(workers) < 6 and len(set(workers)) == len(workers), workers


def test_lora_in_bf16_mixed_precision_trains_only_the_adapters_and_the_merged_model_scores_as_the_adapted_one(
        spark, tokenizer, tmp_path):
    from peft import LoraConfig

    from sparkring import SparkRingModel

    base = text_fns.llama(tokenizer.get_vocab_size())
    before = {k: v.clone() for k, v in base.state_dict().items()}
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    store = Store(str(tmp_path / "store"))
    fitted = _estimator(tokenizer, store, model=base, lora=lora, epochs=1, runId="lora",
                        mergeAdapters=True, precision="bf16-mixed").fit(_text_df(spark, n=120))
    adapted = fitted.getModel()
    adapters = {n: p for n, p in adapted.named_parameters() if "lora_" in n}
    assert sum(p.numel() for p in adapters.values()) == 2 * 2 * (4 * 64 + 64 * 4)  # 2 layers x (q, v) x (A, B)
    # the checkpoint holds the adapters only: the frozen base weights are the model's as built
    checkpoint = torch.load(store.checkpoint_path("lora", "epoch-00000.pt"), weights_only=True)["model"]
    assert sorted(checkpoint) == sorted(adapters)
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)  # B starts at zero: it trained
    for name, value in adapted.get_base_model().state_dict().items():
        if "lora_" not in name:  # every base weight as it was
            torch.testing.assert_close(value, before[name.replace(".base_layer", "")], atol=0, rtol=0)
    texts = spark.createDataFrame([(s,) for s in text_fns.sentences(4, seed=5)], ["text"])
    scoring = fitted.copy({fitted.getParam("inference"): "score"})
    scored = [r.prediction.loss for r in scoring.transform(texts).collect()]
    fitted.write().overwrite().save(str(tmp_path / "merged"))
    loaded = SparkRingModel.load(str(tmp_path / "merged"))
    assert type(loaded.getModel()).__name__ == "LlamaForCausalLM"  # adapters folded in: a plain model
    again = [r.prediction.loss for r in loaded.copy({loaded.getParam("inference"): "score"}).transform(texts).collect()]
    assert again == pytest.approx(scored, abs=1e-4)


def test_a_sequence_classifier_on_labelled_text_beats_the_majority_class(spark, tokenizer, tmp_path):
    pad = Encoder(tokenizer).special_ids()[1]
    train = spark.createDataFrame(text_fns.labelled(200), ["text", "label"])
    test = spark.createDataFrame(text_fns.labelled(60, seed=7), ["text", "label"])
    fitted = _estimator(tokenizer, Store(str(tmp_path / "store")), task="sequence-classification", labelCol="label",
                        model=text_fns.llama_classifier(tokenizer.get_vocab_size(), pad), epochs=3,
                        sequenceLength=16).fit(train)
    assert "perplexity" not in fitted.history[-1] and fitted.history[-1]["tokens_per_second"] > 0
    rows = fitted.transform(test).collect()
    accuracy = sum(r.prediction == r.label for r in rows) / len(rows)
    majority = max(sum(r.label for r in rows), len(rows) - sum(r.label for r in rows)) / len(rows)
    assert accuracy > majority, (accuracy, majority)


def test_a_causal_lm_sharded_with_fsdp_and_checkpointed_at_its_decoder_layers_trains_the_ddp_weights(
        spark, fitted_lm, tokenizer, tmp_path):
    # with every decoder layer's activations recomputed in backward: the same weights, less memory
    sharded = _estimator(tokenizer, Store(str(tmp_path / "store")), epochs=3, strategy="fsdp",
                         activationCheckpointing="full").fit(_text_df(spark))
    for name, value in fitted_lm.getModel().state_dict().items():
        torch.testing.assert_close(sharded.getModel().state_dict()[name], value, atol=1e-4, rtol=0)
    assert sharded.history[-1]["state_bytes"] < fitted_lm.history[-1]["state_bytes"] * 0.6  # each rank keeps half


def test_a_text_model_logged_to_mlflow_generates_from_text_with_its_tokenizer(spark, fitted_lm, tmp_path):
    import mlflow
    import mlflow.transformers
    import pandas as pd

    import sparkring.mlflow

    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    try:
        experiment = mlflow.create_experiment("text", artifact_location=(tmp_path / "a").as_uri())
        mlflow.set_experiment(experiment_id=experiment)
        generating = fitted_lm.copy({fitted_lm.getParam("inference"): "generate"})
        prompts = spark.createDataFrame([("the big cat",), ("the small dog",)], ["text"])
        with mlflow.start_run():
            info = sparkring.mlflow.log_model(generating, "lm", df=prompts)
        pyfunc = mlflow.pyfunc.load_model(info.model_uri)
        served = pyfunc.predict(pd.DataFrame({"text": ["the big cat", "the small dog"]}))["prediction"].tolist()
        assert served == [r.prediction for r in generating.transform(prompts).collect()]
        assert type(sparkring.mlflow.load_model(info.model_uri).getOrDefault("tokenizer")).__name__ == "Tokenizer"
        # MLflow's own transformers flavour too, with the tokenizer
        logged = mlflow.search_logged_models(filter_string="name = 'lm-transformers'", output_format="list")
        assert len(logged) == 1
        components = mlflow.transformers.load_model(logged[0].model_uri, return_type="components")
        for name, value in fitted_lm.getModel().state_dict().items():
            torch.testing.assert_close(components["model"].state_dict()[name], value, atol=0, rtol=0)
        assert components["tokenizer"].encode("the cat") == text_fns.tokenizer().encode("the cat").ids
    finally:
        mlflow.set_tracking_uri(before)


@pytest.fixture(scope="module")
def one_rank_fit(_spark_sessions, tokenizer, tmp_path_factory):
    """A Llama trained on one rank: what every model-parallel split of it must train."""
    df = _text_df(_spark_sessions.get("local"), n=120)
    store = Store(str(tmp_path_factory.mktemp("one-rank") / "store"))
    return df, store, _estimator(tokenizer, store, numProc=1, epochs=1, runId="whole", keepData=True).fit(df)


@pytest.mark.parametrize("split", [dict(tensorParallel=2), dict(pipelineParallel=2)], ids=["tp2", "pp2"])
def test_a_hugging_face_llama_split_over_two_ranks_trains_the_one_rank_weights(
        spark, tokenizer, one_rank_fit, split):
    df, store, whole = one_rank_fit
    fitted = _estimator(tokenizer, store, numProc=2, epochs=1, runId=f"split-{len(split)}-{sorted(split)[0]}",
                        **split).fit(df)
    for name, value in whole.getModel().state_dict().items():
        torch.testing.assert_close(fitted.getModel().state_dict()[name], value, atol=1e-4, rtol=0)
    # tp: q/k/v/gate/up split by rows, o/down by columns; pp: a layer and the embedding or the head
    # each: the largest rank keeps about half the state
    assert fitted.history[-1]["state_bytes"] < whole.history[-1]["state_bytes"] * 0.6


def test_a_packed_row_attends_within_each_document_as_if_it_were_alone(tokenizer, tmp_path):
    from sparkring.data.text import sequences
    from sparkring.estimator.text import token_config
    from sparkring.trainer.activation import without_kv_cache

    est = _estimator(tokenizer, Store(str(tmp_path)))
    encoder = Encoder(tokenizer)
    eos = encoder.special_ids()[0]
    first, second = (ids + [eos] for ids in encoder.encode(["the big cat sat on the mat .", "a small dog ran ."]))
    layout = TextLayout("text", len(first) + len(second) + 3, True, eos, encoder.special_ids()[1])
    row = next(sequences([first, second], layout))  # both documents and padding in one row
    inputs = token_config(est.config(), layout).model_inputs
    assert "attention_mask" not in inputs
    model = text_fns.llama(tokenizer.get_vocab_size()).eval()
    without_kv_cache(model)  # as every rank trains it
    with torch.no_grad():
        packed = model(**{arg: torch.tensor([row[col]]) for arg, col in inputs.items()}).logits[0]
        alone = model(input_ids=torch.tensor([second])).logits[0]
    torch.testing.assert_close(packed[len(first):len(first) + len(second)], alone, atol=1e-5, rtol=0)


def test_a_masked_lm_encoder_learns_to_fill_in_hidden_tokens_and_embeds_text(spark, tmp_path):
    tok = text_fns.tokenizer(mask=True)
    encoder = Encoder(tok)
    pad = encoder.special_ids()[1]
    df = _text_df(spark)
    est = _estimator(tok, Store(str(tmp_path / "store")), task="masked-lm",
                     model=text_fns.bert(tok.get_vocab_size(), pad), epochs=3,
                     optimizer=lambda p: torch.optim.AdamW(p, lr=5e-3))
    # a seeded 15% of each document's real tokens is hidden: the labels are those tokens, and only those
    from sparkring.estimator.text import text_layout
    layout = text_layout(est.config(), df, est.getModel())
    assert not layout.pack and layout.masking.mask_id == tok.token_to_id("<mask>")
    tokenized, counts = tokenize(df, encoder, layout)
    rows = tokenized.collect()
    tokenized.unpersist()
    hidden = [(x, y) for r in rows for x, y in zip(r.input_ids, r.labels) if y != -100]
    words = counts.kept - counts.documents  # end of sequence is never hidden
    assert 0.14 * words < len(hidden) < 0.2 * words  # 15% of the words, at least one a document
    assert 0.7 < sum(x == tok.token_to_id("<mask>") for x, _ in hidden) / len(hidden) < 0.9  # 80% shown as <mask>
    fitted = est.fit(df)
    first, last = fitted.history[0], fitted.history[-1]
    assert last["loss"] < first["loss"] * 0.7 and last["perplexity"] == pytest.approx(math.exp(last["loss"]))
    texts = spark.createDataFrame([("the big cat",), ("a small dog ran .",)], ["text"])
    embedded = fitted.copy({fitted.getParam("inference"): "embed"}).transform(texts).collect()
    assert [len(r.prediction) for r in embedded] == [64, 64]
    with pytest.raises(ConfigurationError, match=r"inference='generate' is a causal language model's"):
        fitted.copy({fitted.getParam("inference"): "generate"}).transform(texts)
    with pytest.raises(ConfigurationError, match=r"task='masked-lm' needs an encoder with a masked-LM head; "
                                                 r"LlamaForCausalLM is not one"):
        _estimator(tok, Store(str(tmp_path / "s")), task="masked-lm").fit(df)


def test_a_text_fit_resumed_after_a_failure_reads_the_stored_token_ids_and_trains_the_uninterrupted_weights(
        spark, fitted_lm, tokenizer, tmp_path):
    import est_helpers as H

    from sparkring.errors import RankFailedError

    counting = text_fns.CountingTokenizer(tokenizer, tmp_path / "encoded")
    store, df = Store(str(tmp_path / "store")), _text_df(spark)
    with pytest.raises(RankFailedError, match="injected failure at epoch 2"):
        _estimator(counting, store, epochs=3, runId="again", keepData=True,
                   callbacks=[H.FailOnce(str(tmp_path / "failed"), epoch=2)]).fit(df)
    assert counting.encoded() == 240  # every document once: the counts and the stored copy read one cached pass
    resumed = _estimator(counting, store, epochs=3, runId="again", keepData=True).fit(df)
    assert counting.encoded() == 240  # the second fit reads the stored int32 ids: nothing is tokenized again
    assert [h["epoch"] for h in resumed.history] == [0, 1, 2]
    assert resumed.history[-1]["tokens"] == fitted_lm.history[-1]["tokens"]
    for name, value in fitted_lm.getModel().state_dict().items():
        torch.testing.assert_close(resumed.getModel().state_dict()[name], value, atol=1e-5, rtol=0)
