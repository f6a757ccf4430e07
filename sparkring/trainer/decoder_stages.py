"""Pipeline stages of a Hugging Face decoder-only language model (a Llama): the embedding, a run of
decoder layers, the final norm and head, each stage holding the model's own modules under their
names, with the batch's position ids (or attention mask) handed to every stage as keywords.

Written by hand because torch's tracer (``torch.distributed.pipelining.pipeline``, through
torch.export) cannot trace transformers' models (their mask functions and caches), and transformers
cuts no pipeline stages itself. torchtitan cuts its own Llama the same way (a stage keeps the layers
between two split points; the first the embedding, the last the norm and output). A stage computes
what ``LlamaModel.forward`` computes around its layers (the causal or packed-documents mask, the
rotary table) from its own inputs, so only the hidden states travel between stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

# Model types whose base model's forward is embed -> rotary -> layers -> norm, as a stage runs it
# (Gemma scales the embedding, Qwen2 and Mistral mix sliding-window masks): only these are cut here.
CUT_MODEL_TYPES = ("llama",)
SPLIT_HINT = "pipelineSplit names decoder layers where stages 1.. begin, e.g. 'model.layers.4'"


@dataclass(frozen=True)
class DecoderPaths:
    """Where a causal LM's parts lie in the model a fit trains (a LoRA wrapper adds a prefix).

    >>> DecoderPaths("base_model.model.").layer(3)
    'base_model.model.model.layers.3'
    """

    prefix: str  # the path of the causal LM in the trained model, with its trailing dot ("" where it is the model)
    base: str = "model"

    @property
    def embed(self) -> str:
        """The input embedding's path."""
        return f"{self.prefix}{self.base}.embed_tokens"

    @property
    def rotary(self) -> str:
        """The rotary table's path (buffers only: every stage keeps it)."""
        return f"{self.prefix}{self.base}.rotary_emb"

    @property
    def norm(self) -> str:
        """The final norm's path."""
        return f"{self.prefix}{self.base}.norm"

    @property
    def head(self) -> str:
        """The output head's path."""
        return f"{self.prefix}lm_head"

    def layer(self, index: int) -> str:
        """Decoder layer ``index``'s path."""
        return f"{self.prefix}{self.base}.layers.{index}"


def find_decoder(model: torch.nn.Module) -> Optional[Tuple[DecoderPaths, Any]]:
    """The Hugging Face causal LM inside ``model`` (itself, or the model a LoRA wraps) with its
    paths, where it has the embed/layers/norm/head layout; None for any other model.

    >>> find_decoder(torch.nn.Linear(2, 2)) is None
    True
    """
    for path, module in model.named_modules():
        base = getattr(module, getattr(module, "base_model_prefix", ""), None)
        if (hasattr(module, "config") and isinstance(getattr(module, "lm_head", None), torch.nn.Module)
                and isinstance(getattr(base, "layers", None), torch.nn.ModuleList)
                and all(hasattr(base, part) for part in ("embed_tokens", "norm", "rotary_emb"))):
            return DecoderPaths(f"{path}." if path else "", module.base_model_prefix), module
    return None


def cuts(model: torch.nn.Module) -> bool:
    """Whether a pipeline cuts ``model`` here, between decoder layers (an ``nn.Sequential`` is cut
    between its children, whatever it holds).

    >>> cuts(torch.nn.Linear(2, 2))
    False
    """
    return not isinstance(model, torch.nn.Sequential) and find_decoder(model) is not None


def refusal(model: torch.nn.Module) -> Optional[str]:
    """Why pipelineParallel cannot cut this Hugging Face model (None: it can, or it is no such model)."""
    found = find_decoder(model)
    if found is None:
        return None
    _, lm = found
    kind = getattr(lm.config, "model_type", "?")
    if kind not in CUT_MODEL_TYPES:
        return (f"cuts Hugging Face decoder models of type {', '.join(CUT_MODEL_TYPES)}; this one is {kind!r}: "
                "train it with strategy='fsdp' or tensorParallel")
    if getattr(lm.config, "tie_word_embeddings", False):
        return ("cannot split a model whose input embedding and output head are one tensor "
                "(tie_word_embeddings=True): the first and the last stage would each hold it; use strategy='fsdp'")
    return None


def layer_ranges(model: torch.nn.Module, split: List[str], stages: int) -> List[range]:
    """Each stage's decoder layers (indices), from the layer names where stages 1.. begin.

    >>> layer_ranges(llama_with_4_layers, ["model.layers.2"], 2)  # doctest: +SKIP
    [range(0, 2), range(2, 4)]
    """
    found = find_decoder(model)
    assert found is not None, "not a Hugging Face decoder model"
    paths, lm = found
    count = len(getattr(lm, paths.base).layers)
    names = {paths.layer(i): i for i in range(count)}
    unknown = [name for name in split if name not in names]
    if unknown or len(split) != stages - 1:
        raise ValueError(f"pipelineSplit {list(split)} does not cut this model's {count} decoder layers into {stages} "
                         f"stages ({f'not decoder layers: {unknown}; ' if unknown else ''}{SPLIT_HINT})")
    bounds = [0] + sorted(names[name] for name in split) + [count]
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"pipelineSplit {list(split)} leaves a stage without decoder layers; {SPLIT_HINT}")
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def place(root: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    """Register ``module`` under ``root`` at ``path`` (dotted), making plain holders on the way."""
    *parents, leaf = path.split(".")
    holder = root
    for name in parents:
        if name not in holder._modules:
            holder.add_module(name, torch.nn.Module())
        holder = holder._modules[name]  # type: ignore[assignment]
    holder.add_module(leaf, module)


class DecoderStage(torch.nn.Module):
    """One pipeline stage of a Llama: its layers (the first stage the embedding too, the last the
    norm and head), the model's own modules at their paths; forward takes token ids (first stage)
    or hidden states, with ``position_ids`` and ``attention_mask`` as keywords, as the model takes them.

    >>> stage = DecoderStage(llama, DecoderPaths(""), range(0, 2), first=True, last=False)  # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, paths: DecoderPaths, layers: range, first: bool, last: bool):
        super().__init__()
        self.paths, self.first, self.last = paths, first, last
        self.layer_paths = [paths.layer(i) for i in layers]
        lm = model.get_submodule(paths.prefix.rstrip(".")) if paths.prefix else model
        self.config = lm.config
        keep = [paths.rotary, *self.layer_paths] + ([paths.embed] if first else []) + \
            ([paths.norm, paths.head] if last else [])
        for path in keep:
            place(self, path, model.get_submodule(path))

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states, or the logits from the last stage, out."""
        from transformers.masking_utils import create_causal_mask

        hidden = self.get_submodule(self.paths.embed)(x) if self.first else x
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None,
                                  position_ids=position_ids)
        rotary = self.get_submodule(self.paths.rotary)(hidden, position_ids=position_ids)
        for path in self.layer_paths:
            out = self.get_submodule(path)(hidden, attention_mask=mask, position_embeddings=rotary,
                                           position_ids=position_ids, use_cache=False)
            hidden = out[0] if isinstance(out, tuple) else out
        if self.last:
            hidden = self.get_submodule(self.paths.head)(self.get_submodule(self.paths.norm)(hidden))
        return hidden


def cut(model: torch.nn.Module, split: List[str], stages: int) -> List[torch.nn.Module]:
    """Every stage of ``model`` (a Llama, or a LoRA around one), in order; the stages share the model's modules."""
    found = find_decoder(model)
    assert found is not None, "not a Hugging Face decoder model"
    ranges = layer_ranges(model, split, stages)
    return [DecoderStage(model, found[0], layers, first=i == 0, last=i == len(ranges) - 1)
            for i, layers in enumerate(ranges)]
