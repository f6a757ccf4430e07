"""Tiny pretrained checkpoints the storage tests save themselves (save_pretrained; nothing downloads)."""
import torch


def llama_config(vocab_size=64, tied=False, layers=2, hidden=64):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=64, tie_word_embeddings=tied)


def save_llama(path, vocab_size=64, tied=False, dtype=torch.float32, seed=3, max_shard_size=None, tokenizer=None):
    """A tiny Llama saved as a Hugging Face directory (sharded with an index where max_shard_size says)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(vocab_size, tied)).to(dtype)
    model.save_pretrained(str(path), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer is not None:
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>").save_pretrained(
            str(path))
    return {k: v.clone() for k, v in model.state_dict().items()}


def from_pretrained(path):
    """The guide's factory form (a picklable callable; the tests' lambdas would do as well)."""
    def factory():
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(path))
    return factory


def frozen(params):
    """An optimizer that does not move the weights (lr=0): the fitted model is what was loaded."""
    return torch.optim.SGD(params, lr=0.0)


def mlp_factory():
    """A plain torch model's factory (initialWeights fills it)."""
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def save_mlp_weights(directory, form):
    """mlp_factory's model with distinct values, saved as ``form`` (safetensors file or directory, DCP
    directory, torch file); the path to give initialWeights and the values."""
    import os

    torch.manual_seed(11)
    state = {k: torch.randn_like(v) for k, v in mlp_factory().state_dict().items()}
    os.makedirs(directory, exist_ok=True)
    if form == "safetensors":
        from safetensors.torch import save_file

        path = os.path.join(directory, "weights.safetensors")
        save_file(state, path)
    elif form == "safetensors-directory":
        from safetensors.torch import save_file

        path = directory
        names = sorted(state)
        save_file({k: state[k] for k in names[:2]}, os.path.join(path, "part-1.safetensors"))
        save_file({k: state[k] for k in names[2:]}, os.path.join(path, "part-2.safetensors"))
    elif form == "dcp":
        import torch.distributed.checkpoint as dcp

        path = os.path.join(directory, "dcp")
        dcp.save({k: v.clone() for k, v in state.items()}, checkpoint_id=path, no_dist=True)
    else:
        path = os.path.join(directory, "weights.pt")
        torch.save(state, path)
    return path, state


def wide_mlp_factory():
    """About 17 million parameters (67 MB): a model the payload and the results must not carry."""
    return torch.nn.Sequential(torch.nn.Linear(8, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                               torch.nn.ReLU(), torch.nn.Linear(4096, 3))
