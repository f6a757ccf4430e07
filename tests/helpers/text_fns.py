"""Tiny language models and text for the text tests: a BPE tokenizer trained on the tests' own
sentences and a 2-layer Llama built from its config (nothing is downloaded)."""
import os
import random

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "under", "a", "mat", "tree", "big", "small", "red", "blue"]


def sentences(n=240, seed=0):
    """Short documents with a structure a tiny model learns in two epochs."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        subject = f"the {rng.choice(['big', 'small'])} {rng.choice(['cat', 'dog'])}"
        out.append(f"{subject} {rng.choice(['sat', 'ran'])} {rng.choice(['on', 'under'])} the "
                   f"{rng.choice(['red', 'blue'])} {rng.choice(['mat', 'tree'])} .")
    return out


def tokenizer(mask=False):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=64, special_tokens=["<pad>", "</s>", "<unk>"] + (["<mask>"] * mask))
    tok.train_from_iterator(sentences(), trainer)
    return tok


class CountedTokenizer:
    """A tokenizers.Tokenizer that writes its process id to ``path`` each time it is unpickled."""

    def __init__(self, tok, path):
        self.tok, self.path = tok, path

    def __setstate__(self, state):
        self.__dict__.update(state)
        with open(self.path, "a") as out:
            out.write(f"{os.getpid()}\n")

    def __getattr__(self, name):  # encode_batch, decode, token_to_id, ... (not while unpickling)
        if name in ("tok", "path", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.tok, name)


def llama(vocab_size, seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def labelled(n=200, seed=0):
    """(text, label) rows: 1 where the sentence is about a cat, 0 about a dog."""
    return [(s, float("cat" in s.split())) for s in sentences(n, seed)]


def llama_classifier(vocab_size, pad_id, seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, num_labels=2,
                         pad_token_id=pad_id)
    return LlamaForSequenceClassification(config)


def bert(vocab_size, pad_id, seed=0):
    """A 2-layer BERT encoder with its masked-LM head."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, pad_token_id=pad_id)
    return BertForMaskedLM(config)


class CountingTokenizer:
    """A tokenizers.Tokenizer that writes a line to ``log`` for every batch it encodes (executors are
    other processes: the file is what comes back)."""

    def __init__(self, tokenizer, log):
        self.inner, self.log = tokenizer, str(log)

    def encode_batch(self, texts):
        with open(self.log, "a") as out:
            out.write(f"{len(texts)}\n")
        return self.inner.encode_batch(texts)

    def __getattr__(self, name):
        if name in ("inner", "log") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def encoded(self):
        """How many documents were encoded so far."""
        try:
            with open(self.log) as lines:
                return sum(int(line) for line in lines)
        except FileNotFoundError:
            return 0
