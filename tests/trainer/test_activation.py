"""Activation checkpointing (activationCheckpointing): fewer activations kept for backward, the
same gradients, the same state_dict keys. Fast: one process, no Spark."""
import parallel_fns as P
import pytest
import torch

from sparkring.trainer.activation import checkpoint_activations


def _saved_bytes_and_grads(mode):
    torch.manual_seed(0)
    model = P.TinyDecoder(layers=4)
    wrapped = checkpoint_activations(model, mode, ("Block",))
    ids = torch.randint(0, 16, (8, 8))
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.cross_entropy(model(ids), torch.randint(0, 16, (8,)))
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    return wrapped, sum(kept), grads, sorted(model.state_dict())


def test_checkpointing_blocks_keeps_fewer_activations_for_the_same_gradients():
    _, none_bytes, none_grads, keys = _saved_bytes_and_grads("none")
    blocks, full_bytes, full_grads, full_keys = _saved_bytes_and_grads("full")
    half, selective_bytes, selective_grads, _ = _saved_bytes_and_grads("selective")
    assert (blocks, half) == (4, 2)
    # each checkpointed block keeps its input only, recomputing the rest in backward
    assert full_bytes < selective_bytes < none_bytes
    assert full_bytes < none_bytes * 0.4
    assert full_keys == keys  # checkpoints and the fitted model keep the plain names
    assert full_grads.keys() == selective_grads.keys() == none_grads.keys()
    for name, grad in none_grads.items():
        torch.testing.assert_close(full_grads[name], grad, atol=1e-6, rtol=0)
        torch.testing.assert_close(selective_grads[name], grad, atol=1e-6, rtol=0)


def test_an_unknown_mode_is_refused_by_the_param_table():
    from sparkring.errors import ConfigurationError
    from sparkring.estimator.params import check_values

    with pytest.raises(ConfigurationError, match="activationCheckpointing='some': use one of 'none', 'full'"):
        check_values({"activationCheckpointing": "some"})


def test_a_hugging_face_model_is_cut_at_the_decoder_layers_it_declares():
    pytest.importorskip("transformers")
    from text_fns import llama

    from sparkring.trainer.activation import named_blocks

    names = [name for name, _ in named_blocks(llama(64), ())]
    assert names == ["model.layers.0", "model.layers.1"]  # the unit FSDP shards and checkpointing wraps
