"""A checkpoint read in one process as from_pretrained reads it: values, dtypes, tied weights, rotary
tables; the names wrappers add are not a checkpoint's."""
import pytest
import stored_fns
import torch

from sparkring.trainer import pretrained
from sparkring.trainer.stored import Location

pytest.importorskip("transformers")


@pytest.mark.parametrize("tied,dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_an_empty_build_filled_from_the_directory_equals_from_pretrained(tmp_path, tied, dtype):
    from transformers import AutoModelForCausalLM

    stored_fns.save_llama(tmp_path, tied=tied, dtype=dtype)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    stored = pretrained.stored_model(stored_fns.from_pretrained(tmp_path), None)
    assert stored.empty and stored.module.dtype == dtype  # the driver's view: no values, the stored dtype
    model = pretrained.materialized(stored, torch.device("cpu"))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    expected = dict(reference.state_dict())
    expected.update({f"{n}#buffer": b for n, b in reference.named_buffers()})
    got = dict(model.state_dict())
    got.update({f"{n}#buffer": b for n, b in model.named_buffers()})
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=0, rtol=0, msg=name)
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, atol=0, rtol=0)


def test_a_directory_given_by_path_builds_its_architecture_and_names_strip_wrappers(tmp_path):
    stored_fns.save_llama(tmp_path)
    model = pretrained.HuggingFaceDirectory(str(tmp_path))()
    assert type(model).__name__ == "LlamaForCausalLM" and not model.lm_head.weight.is_meta
    source = pretrained.WeightsSource(Location(str(tmp_path)), prefix="base_model.model.")
    assert pretrained.stored_name("base_model.model.model.layers.0._checkpoint_wrapped_module.self_attn."
                                  "q_proj.base_layer.weight", source) == "model.layers.0.self_attn.q_proj.weight"
    assert pretrained.stored_name("classifier.weight", source) is None


def test_three_ranks_writing_their_own_files_make_one_directory_from_pretrained_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    from sparkring import Store
    from sparkring.trainer import saving

    stored_fns.save_llama(tmp_path / "llama")
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama"))
    state = reference.state_dict()
    sizes = [(name, t.numel() * t.element_size()) for name, t in state.items()]
    out, asked = str(tmp_path / "written"), []

    def whole(name):  # what the collective puts together; each rank asks for every tensor in order
        asked.append(name)
        return state[name]

    written = [saving.write_from_every_rank(Store(str(tmp_path)), out, sizes, whole, rank, 3) for rank in range(3)]
    assert asked == [name for name, _ in sizes] * 3
    assert [len(files) for files in written] == [1, 1, 1] and len({f for files in written for f in files}) == 3
    reference.config.save_pretrained(out)
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, value in state.items():
        torch.testing.assert_close(loaded[name], value, atol=0, rtol=0, msg=name)
