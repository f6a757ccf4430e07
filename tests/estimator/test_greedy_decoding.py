"""Greedy decoding of a Llama written out in torch ops: the tokens Hugging Face's generate()
returns for the same left-padded prompts, and generate() wherever the settings or the model ask
for more than greedy decoding. No Spark: a tiny Llama built from its config."""
import pytest
import torch

from sparkring.estimator.greedy_decoding import GreedyLlama

transformers = pytest.importorskip("transformers")

PAD, EOS = 0, 1


def _llama(kv_heads=2, **config):
    torch.manual_seed(3)
    settings = dict(vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=kv_heads, max_position_embeddings=64)
    settings.update(config)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()


def _left_padded(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(2, 48, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids, mask


def _generated(model, ids, mask, new_tokens, eos=EOS):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=PAD, eos_token_id=eos)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("kv_heads,dtype", [(4, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_greedy_decoding_returns_the_tokens_generate_returns_for_left_padded_prompts(kv_heads, dtype):
    model = _llama(kv_heads).to(dtype)
    ids, mask = _left_padded([3, 9, 1, 6, 9])
    decoder = GreedyLlama.for_model(model, {"max_new_tokens": 12, "do_sample": False})
    assert decoder is not None
    ours = decoder.generate(ids, mask, 12, EOS, PAD)
    assert ours.shape == (5, 12)
    assert torch.equal(ours, _generated(model, ids, mask, 12))


def test_a_row_that_reaches_end_of_sequence_holds_padding_and_decoding_stops_when_every_row_has():
    model = _llama()
    ids, mask = _left_padded([4, 7, 5], seed=1)
    free = _generated(model, ids, mask, 10, eos=-1)
    row = free[0].tolist()
    ends = next(step for step in range(1, 10) if row[step] not in row[:step])
    eos = row[ends]  # ends row 0 after `ends` tokens, where it first writes it
    decoder = GreedyLlama.for_model(model, {"max_new_tokens": 10})
    ours = decoder.generate(ids, mask, 10, eos, PAD)
    theirs = _generated(model, ids, mask, 10, eos=eos)
    assert torch.equal(ours, theirs)
    assert ours[0, ends] == eos and (ours[0, ends + 1:] == PAD).all()
    alone = decoder.generate(ids[:1], mask[:1], 10, eos, PAD)
    assert alone.shape == (1, ends + 1)  # the one row has ended: no more steps


@pytest.mark.parametrize("settings", [{"do_sample": True}, {"num_beams": 2}, {"repetition_penalty": 1.3},
                                      {"no_repeat_ngram_size": 2}, {}])
def test_settings_beyond_greedy_decoding_leave_the_batch_to_generate(settings):
    covered = {"max_new_tokens": 8, "do_sample": False, "temperature": 0.7}
    assert GreedyLlama.for_model(_llama(), covered) is not None
    if not settings:  # a model whose own generation config samples
        model = _llama()
        model.generation_config.do_sample = True
        assert GreedyLlama.for_model(model, {"max_new_tokens": 8}) is None
        return
    assert GreedyLlama.for_model(_llama(), {"max_new_tokens": 8, **settings}) is None


def test_models_it_does_not_reproduce_are_left_to_generate():
    scaled = _llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    assert GreedyLlama.for_model(scaled, {"max_new_tokens": 8}) is None
    assert GreedyLlama.for_model(_llama(attention_bias=True), {"max_new_tokens": 8}) is None
    assert GreedyLlama.for_model(_llama(attn_implementation="eager"), {"max_new_tokens": 8}) is None
    torch.manual_seed(0)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    assert GreedyLlama.for_model(mistral, {"max_new_tokens": 8}) is None
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(_llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert GreedyLlama.for_model(adapted, {"max_new_tokens": 8}) is None
