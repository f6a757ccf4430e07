"""Models that begin and end on storage: a factory calling from_pretrained, a checkpoint directory
(a path or an S3 URL), initialWeights, under every placement; what is refused before any Spark job.
Real Spark, tiny Llamas the tests save with save_pretrained."""
import json

import pytest
import stored_fns
import text_fns
import torch

from sparkring import SparkRingEstimator, Store
from sparkring.errors import ConfigurationError
from sparkring.estimator.fitted import FittedWeights

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


@pytest.mark.parametrize("placement", [dict(strategy="ddp"), dict(strategy="fsdp"), dict(tensorParallel=2),
                                       dict(pipelineParallel=2)], ids=["ddp", "fsdp", "tp2", "pp2"])
def test_a_from_pretrained_factory_starts_every_placement_from_the_checkpoint(
        spark, checkpoint, tokenizer, tmp_path, placement):
    path, expected = checkpoint
    fitted = _estimator(stored_fns.from_pretrained(path), tokenizer, Store(str(tmp_path / "store")),
                        **placement).fit(_text_df(spark))
    _assert_same(fitted, expected)


@pytest.mark.parametrize("placement", [dict(strategy="ddp"), dict(strategy="fsdp"), dict(tensorParallel=2),
                                       dict(pipelineParallel=2)], ids=["ddp", "fsdp", "tp2", "pp2"])
def test_a_checkpoint_directory_is_a_model(spark, checkpoint, tokenizer, tmp_path, placement):
    path, expected = checkpoint
    fitted = _estimator(str(path), tokenizer, Store(str(tmp_path / "store")), **placement).fit(_text_df(spark))
    _assert_same(fitted, expected)
    assert type(fitted.getModel()).__name__ == "LlamaForCausalLM"
    written = sorted(p.name for p in (tmp_path / "store").rglob("model*.safetensors*"))
    if placement == dict(strategy="ddp"):  # rank 0 holds the whole model and writes it
        assert written == ["model.safetensors"]
        return
    # each rank wrote its own file of the fitted weights (fsdp, tp2: its run of tensors; pp2: its
    # stage): rank 0 never held the whole model
    assert written == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                       "model.safetensors.index.json"]
    index = json.loads(next((tmp_path / "store").rglob("model.safetensors.index.json")).read_text())["weight_map"]
    assert index["model.embed_tokens.weight"] == written[0] and index["lm_head.weight"] == written[1]
    assert index.keys() == expected.keys()


def test_a_bf16_checkpoint_with_tied_embeddings_stays_bf16_and_tied_under_fsdp(spark, tokenizer, tmp_path):
    path = tmp_path / "bf16"
    expected = stored_fns.save_llama(path, tokenizer.get_vocab_size(), tied=True, dtype=torch.bfloat16)
    fitted = _estimator(stored_fns.from_pretrained(path), tokenizer, Store(str(tmp_path / "store")),
                        strategy="fsdp").fit(_text_df(spark))
    _assert_same(fitted, expected)
    model = fitted.getModel()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_a_sharded_checkpoint_with_an_index_on_s3_is_read_by_every_rank(spark, s3, tokenizer, tmp_path):
    import fsspec

    local = tmp_path / "sharded"
    expected = stored_fns.save_llama(local, tokenizer.get_vocab_size(), max_shard_size="60KB")
    assert (local / "model.safetensors.index.json").exists()
    store = s3.store("stored-models")
    fs = fsspec.filesystem("s3", **s3.storage_options)
    fs.put(str(local), "runs/checkpoints/sharded", recursive=True)
    fitted = _estimator("s3://runs/checkpoints/sharded", tokenizer, store, strategy="fsdp").fit(_text_df(spark))
    _assert_same(fitted, expected)


@pytest.mark.parametrize("form,placement", [("safetensors", dict(pipelineParallel=2, pipelineSplit=["2"])),
                                            ("safetensors-directory", {}), ("dcp", dict(strategy="fsdp")),
                                            ("torch", {})], ids=["safetensors-pp2", "directory", "dcp-fsdp", "torch"])
def test_initial_weights_fill_a_plain_factory_model_from_each_stored_form(spark, tmp_path, form, placement):
    from est_helpers import classification_df

    path, expected = stored_fns.save_mlp_weights(str(tmp_path / "weights"), form)
    fitted = SparkRingEstimator(model=stored_fns.mlp_factory, optimizer=stored_fns.frozen, loss="cross_entropy",
                                initialWeights=path, numProc=2, batchSize=16, epochs=1,
                                store=Store(str(tmp_path / "store")), verbose=0, **placement,
                                ).fit(classification_df(spark, n=96))
    _assert_same(fitted, expected)


def test_stored_weights_that_do_not_fit_are_refused_before_any_spark_job(spark, checkpoint, tokenizer, tmp_path):
    from est_helpers import classification_df
    from safetensors.torch import save_file

    path, _ = checkpoint
    store = Store(str(tmp_path / "store"))
    df = classification_df(spark, n=32)
    jobs = len(spark.sparkContext.statusTracker().getJobIdsForGroup())
    (tmp_path / "no-config").mkdir()
    with pytest.raises(ConfigurationError, match=r"no-config has no config.json"):
        _estimator(str(tmp_path / "no-config"), tokenizer, store).fit(_text_df(spark))
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ConfigurationError, match=r"no-weights holds no weights"):
        _estimator(str(tmp_path / "no-weights"), tokenizer, store).fit(_text_df(spark))
    wrong = {k: torch.zeros(v.shape[::-1]) for k, v in stored_fns.mlp_factory().state_dict().items()}
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ConfigurationError, match=r"wrong.safetensors: tensor '0.weight' is \[8, 16\], but the "
                                                 r"model's '0.weight' is \[16, 8\]"):
        SparkRingEstimator(model=stored_fns.mlp_factory, loss="cross_entropy", store=store, numProc=2,
                           initialWeights=str(tmp_path / "wrong.safetensors")).fit(df)
    save_file({"0.weight": torch.zeros(16, 8)}, str(tmp_path / "partial.safetensors"))
    with pytest.raises(ConfigurationError, match=r"partial.safetensors lacks 3 of the model's tensors"):
        SparkRingEstimator(model=stored_fns.mlp_factory, loss="cross_entropy", store=store, numProc=2,
                           initialWeights=str(tmp_path / "partial.safetensors")).fit(df)
    tied = tmp_path / "tied"
    stored_fns.save_llama(tied, tokenizer.get_vocab_size(), tied=True)
    with pytest.raises(ConfigurationError, match=r"pipelineParallel=2 cannot split a model whose input embedding "
                                                 r"and output head are one tensor \(tie_word_embeddings=True\)"):
        _estimator(str(tied), tokenizer, store, pipelineParallel=2).fit(_text_df(spark))
    with pytest.raises(ConfigurationError, match=r"not decoder layers: \['model.norm'\]; pipelineSplit names decoder "
                                                 r"layers where stages 1.. begin, e.g. 'model.layers.4'"):
        _estimator(str(path), tokenizer, store, pipelineParallel=2, pipelineSplit=["model.norm"]).fit(_text_df(spark))
    assert len(spark.sparkContext.statusTracker().getJobIdsForGroup()) == jobs


@pytest.mark.parametrize("placement", [dict(strategy="fsdp"), dict(pipelineParallel=2)], ids=["fsdp", "pp2"])
def test_lora_on_a_from_pretrained_factory_starts_from_the_checkpoint_with_adapters_that_change_nothing(
        spark, checkpoint, tokenizer, tmp_path, placement):
    from peft import LoraConfig

    path, expected = checkpoint
    fitted = _estimator(stored_fns.from_pretrained(path), tokenizer, Store(str(tmp_path / "store")), **placement,
                        lora=LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).fit(_text_df(spark))
    state = fitted.getModel().state_dict()
    for name, value in expected.items():
        wrapped = name.replace("q_proj.", "q_proj.base_layer.").replace("v_proj.", "v_proj.base_layer.")
        torch.testing.assert_close(state["base_model.model." + wrapped], value, atol=0, rtol=0, msg=name)
    b = [v for k, v in state.items() if "lora_B" in k]
    assert b and all(not v.any() for v in b)  # peft's start: the adapted model is the checkpoint's
    a = [v for k, v in state.items() if "lora_A" in k]
    assert a and all(v.abs().sum() > 0 for v in a)


def _sizes(text, pattern):
    import re

    return [int(n) for n in re.findall(pattern, text)]


def test_a_model_of_tens_of_millions_of_parameters_never_travels_through_spark(spark, tmp_path, caplog):
    import logging

    from est_helpers import classification_df
    from safetensors.torch import save_file

    caplog.set_level(logging.INFO, logger="sparkring")
    store = Store(str(tmp_path / "store"))
    df = classification_df(spark, n=64)
    fitted = SparkRingEstimator(model=stored_fns.wide_mlp_factory, optimizer=stored_fns.frozen, loss="cross_entropy",
                                numProc=2, batchSize=16, epochs=1, store=store, verbose=0, runId="wide").fit(df)
    model_bytes = sum(p.numel() * 4 for p in stored_fns.wide_mlp_factory().parameters())
    payloads, results = _sizes(caplog.text, r"a payload of (\d+) bytes"), _sizes(caplog.text, r"result: (\d+) bytes")
    assert payloads and results and max(payloads + results) < 100_000 < model_bytes // 500
    # the weights are read from the Store when asked for: getModel() on the driver, transform() on the executors
    replaced = {k: torch.full_like(v, 0.01) for k, v in stored_fns.wide_mlp_factory().state_dict().items()}
    save_file(replaced, store.model_path("wide", "model.safetensors"))
    scored = fitted.transform(df).select("probability").head()
    assert scored.probability.toArray().tolist() == pytest.approx([1 / 3] * 3, abs=1e-5)  # equal weights: equal classes
    torch.testing.assert_close(fitted.getModel()[0].weight, replaced["0.weight"])


def test_a_large_model_object_reaches_the_ranks_through_the_store(spark, tmp_path, caplog, monkeypatch):
    import logging

    from est_helpers import classification_df

    import sparkring.estimator.launching as launching

    monkeypatch.setattr(launching, "OBJECTS_THROUGH_STORE_BYTES", 1024)  # the tiny model counts as large
    caplog.set_level(logging.INFO, logger="sparkring")
    net = stored_fns.wide_mlp_factory()
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    fitted = SparkRingEstimator(model=net, optimizer=stored_fns.frozen, loss="cross_entropy", numProc=2, batchSize=16,
                                epochs=1, store=Store(str(tmp_path / "store")), strategy="fsdp", verbose=0,
                                ).fit(classification_df(spark, n=64))
    assert "goes to the ranks through" in caplog.text
    assert max(_sizes(caplog.text, r"a payload of (\d+) bytes")) < 100_000
    _assert_same(fitted, expected)


def test_a_saved_fit_is_a_hugging_face_directory_a_peft_adapter_or_safetensors(spark, checkpoint, tokenizer, tmp_path,
                                                                                  monkeypatch):
    import json

    from est_helpers import adam, classification_df
    from peft import LoraConfig, PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparkring import SparkRingModel

    path, _ = checkpoint
    store, df = Store(str(tmp_path / "store")), _text_df(spark)
    trained = dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    full = _estimator(stored_fns.from_pretrained(path), tokenizer, store, strategy="fsdp", **trained).fit(df)
    with monkeypatch.context() as saving:  # the files the ranks wrote are copied: the driver reads no weights
        saving.setattr(FittedWeights, "load", _no_weights_read_on_the_driver)
        full.write().save(str(tmp_path / "full"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "full" / "model"))
    _assert_same_module(exported, full.getModel())
    assert AutoTokenizer.from_pretrained(str(tmp_path / "full" / "model")).encode("the cat") == \
        tokenizer.encode("the cat").ids
    assert "objects.pkl" in {p.name for p in (tmp_path / "full").iterdir()}
    _assert_same_module(SparkRingModel.load(str(tmp_path / "full")).getModel(), full.getModel())

    lora = _estimator(stored_fns.from_pretrained(path), tokenizer, store, lora=LoraConfig(r=4, target_modules=[
        "q_proj", "v_proj"]), **trained).fit(df)
    lora.write().save(str(tmp_path / "lora"))
    adapter = tmp_path / "lora" / "model"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    assert any(v.abs().sum() > 0 for k, v in load_file(str(adapter / "adapter_model.safetensors")).items()
               if "lora_B" in k)  # the adapters trained
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(path)), str(adapter))
    _assert_same_module(peft, lora.getModel())
    _assert_same_module(SparkRingModel.load(str(tmp_path / "lora")).getModel(), lora.getModel())

    plain = SparkRingEstimator(model=stored_fns.mlp_factory, optimizer=adam, loss="cross_entropy", numProc=2,
                               batchSize=16, epochs=1, store=store, verbose=0).fit(classification_df(spark, n=64))
    with monkeypatch.context() as saving:
        saving.setattr(FittedWeights, "load", _no_weights_read_on_the_driver)
        plain.write().save(str(tmp_path / "plain"))
    values = load_file(str(tmp_path / "plain" / "model" / "model.safetensors"))
    _assert_same_module(plain.getModel(), values)
    reloaded = SparkRingModel.load(str(tmp_path / "plain"))
    _assert_same_module(reloaded.getModel(), values)
    assert reloaded.transform(classification_df(spark, n=8)).count() == 8


def _no_weights_read_on_the_driver(*args, **kwargs):
    raise AssertionError("save() read the fitted weights on the driver")


def _assert_same_module(module, expected):
    state = module.state_dict()
    expected = expected if isinstance(expected, dict) else expected.state_dict()
    assert set(state) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, atol=0, rtol=0, msg=name)


def test_a_model_saved_by_an_earlier_version_still_loads(spark, tmp_path):
    import io

    from est_helpers import adam, classification_df

    from sparkring import SparkRingModel
    from sparkring.estimator.persistence import SparkRingWriter

    fitted = SparkRingEstimator(model=stored_fns.mlp_factory, optimizer=adam, loss="cross_entropy", numProc=2,
                                batchSize=16, epochs=1, store=Store(str(tmp_path / "store")), verbose=0,
                                ).fit(classification_df(spark, n=64))
    module = fitted.getModel()
    old = fitted.copy({fitted.getParam("model"): module})  # the module pickled whole, its state beside it
    buf = io.BytesIO()
    torch.save(module.state_dict(), buf)
    SparkRingWriter(old, extra={"history": old.history}, blobs={"state_dict.pt": buf.getvalue()}).save(
        str(tmp_path / "old"))
    _assert_same_module(SparkRingModel.load(str(tmp_path / "old")).getModel(), module)


def test_a_pretrained_ddp_fit_checkpoints_as_dcp_and_resumes_at_another_num_proc(spark, checkpoint, tokenizer,
                                                                                 tmp_path):
    path, _ = checkpoint
    store, df = Store(str(tmp_path / "store")), _text_df(spark)
    trained = dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), runId="pre")
    first = _estimator(stored_fns.from_pretrained(path), tokenizer, store, **trained).fit(df)
    assert any(name.endswith(".dcp") for name in store.listdir(store.checkpoint_path("pre")))
    resumed = _estimator(stored_fns.from_pretrained(path), tokenizer, store, numProc=1, epochs=2, **trained).fit(df)
    assert [e["epoch"] for e in resumed.history] == [0, 1]
    assert resumed.history[0]["loss"] == first.history[0]["loss"]  # epoch 0 was not trained again
