"""Greedy decoding of Llama-architecture causal LMs in plain torch ops over a preallocated KV cache.

Written by hand because nothing in the libraries does this cheaply for transform()'s batches:
Hugging Face's ``generate()`` spends most of a small or mid-sized model's step in Python (the
cache objects, the 4-D mask rebuilt every step, logits processors and stopping criteria), and
``torch.compile`` takes longer to compile than a transform takes to run. It reads the model's own
weights (no copies), reproduces ``LlamaForCausalLM``'s arithmetic op for op (RMSNorm in float32,
rotary embedding, scaled dot-product attention, SwiGLU), and stops rows at end of sequence as
``generate()`` does; anything it does not cover (sampling, beams, penalties, other architectures,
rope scaling, biases, attention other than sdpa, a LoRA wrapper) goes to ``generate()``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# generate() settings that greedy decoding honours (or that do not change its tokens); any other
# setting that differs from transformers' defaults sends the batch to generate()
_GREEDY_SETTINGS = {"max_new_tokens", "max_length", "do_sample", "num_beams", "use_cache", "pad_token_id",
                    "eos_token_id", "bos_token_id", "temperature", "top_k", "top_p", "transformers_version",
                    "_from_model_config", "output_attentions", "output_hidden_states", "output_scores", "output_logits"}


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights, the model's own tensors."""

    attention_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class GreedyLlama:
    """Greedy continuations of left-padded prompts for a ``LlamaForCausalLM``, token for token
    what its ``generate(do_sample=False)`` returns, with less work per step.

    >>> decoder = GreedyLlama.for_model(model, {"max_new_tokens": 16})  # doctest: +SKIP
    >>> decoder.generate(ids, mask, max_new_tokens=16, eos_id=1, pad_id=0).shape  # doctest: +SKIP
    torch.Size([32, 16])
    """

    def __init__(self, model: Any) -> None:  # a LlamaForCausalLM (transformers is an extra)
        config, inner = model.config, model.model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.embedding = inner.embed_tokens.weight
        self.layers = [_Layer(layer.input_layernorm.weight, layer.self_attn.q_proj.weight,
                              layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight,
                              layer.self_attn.o_proj.weight, layer.post_attention_layernorm.weight,
                              layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight)
                       for layer in inner.layers]
        self.final_norm, self.head = inner.norm.weight, model.lm_head.weight
        self.inv_freq, self.rope_scale = inner.rotary_emb.inv_freq, inner.rotary_emb.attention_scaling

    @classmethod
    def for_model(cls, model: torch.nn.Module, settings: Dict[str, Any]) -> Optional["GreedyLlama"]:
        """The decoder for ``model`` under these generate() settings, or None where generate()
        must run (the reason is logged at debug level)."""
        reason = _not_covered(model, settings)
        if reason:
            logger.debug("generate() runs this batch: %s", reason)
            return None
        return cls(model)

    @torch.inference_mode()
    def generate(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, eos_id: int,
                 pad_id: int) -> torch.Tensor:
        """The new tokens of each left-padded prompt (``max_new_tokens`` columns or fewer when every
        row has ended; a row that ended holds ``pad_id`` after its end of sequence)."""
        batch, width = ids.shape
        cache = _KVCache.empty(len(self.layers), batch, self.kv_heads, width + max_new_tokens, self.head_dim,
                               self.embedding)
        keep = torch.zeros(batch, width + max_new_tokens, dtype=torch.bool, device=ids.device)
        keep[:, :width] = mask.bool()
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
        # a padding position attends to itself only, so no softmax row is empty
        allowed = (causal & keep[:, None, None, :width]) | torch.eye(width, dtype=torch.bool, device=ids.device)
        rotary = self._rotary(width + max_new_tokens, ids.device)
        logits = self._forward(ids, positions, allowed, cache, 0, rotary)
        new = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=ids.device)
        ended = torch.zeros(batch, dtype=torch.bool, device=ids.device)
        next_position = positions[:, -1:] + 1
        for step in range(max_new_tokens):
            token = torch.where(ended, pad_id, logits.argmax(-1))
            new[:, step] = token
            ended |= token == eos_id
            if step == max_new_tokens - 1 or bool(ended.all()):
                return new[:, :step + 1]
            keep[:, width + step] = True
            logits = self._forward(token[:, None], next_position, keep[:, None, None, :width + step + 1], cache,
                                   width + step, rotary)
            next_position = next_position + 1
        return new

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, cache: "_KVCache",
                 start: int, rotary: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The last position's logits of ``ids`` at ``positions``, their keys and values written to
        the cache from column ``start``."""
        batch, length = ids.shape
        x = F.embedding(ids, self.embedding)
        cos, sin = (table[positions].to(x.dtype)[:, None] for table in rotary)
        for i, layer in enumerate(self.layers):
            h = self._norm(x, layer.attention_norm)
            q = self._rotate(F.linear(h, layer.q).view(batch, length, self.heads, -1).transpose(1, 2), cos, sin)
            k = self._rotate(F.linear(h, layer.k).view(batch, length, self.kv_heads, -1).transpose(1, 2), cos, sin)
            v = F.linear(h, layer.v).view(batch, length, self.kv_heads, -1).transpose(1, 2)
            keys, values = cache.write(i, k, v, start)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed,
                                               enable_gqa=self.heads != self.kv_heads)
            x = x + F.linear(y.transpose(1, 2).reshape(batch, length, -1), layer.o)
            h = self._norm(x, layer.mlp_norm)
            x = x + F.linear(F.silu(F.linear(h, layer.gate)) * F.linear(h, layer.up), layer.down)
        return F.linear(self._norm(x[:, -1], self.final_norm), self.head)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # LlamaRMSNorm: normalized in float32, scaled by the weight in the model's dtype
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps=self.eps)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def _rotary(self, length: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions 0..length-1 in float32 (as LlamaRotaryEmbedding computes
        them), sin negated in its first half so that rotating half a vector is one roll."""
        freqs = torch.arange(length, device=device)[:, None].float() * self.inv_freq.float().to(device)
        angles = torch.cat((freqs, freqs), dim=-1)
        half = angles.shape[-1] // 2
        sign = torch.cat((-torch.ones(half, device=device), torch.ones(half, device=device)))
        return angles.cos() * self.rope_scale, angles.sin() * self.rope_scale * sign

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1) = roll(x) with x2 negated
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


@dataclass
class _KVCache:
    """Keys and values of every layer, preallocated for the prompt and the new tokens."""

    keys: List[torch.Tensor]
    values: List[torch.Tensor]

    @classmethod
    def empty(cls, layers: int, batch: int, heads: int, length: int, head_dim: int, like: torch.Tensor) -> "_KVCache":
        shape = (batch, heads, length, head_dim)
        return cls([like.new_zeros(shape) for _ in range(layers)], [like.new_zeros(shape) for _ in range(layers)])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> Tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def _not_covered(model: Any, settings: Dict[str, Any]) -> str:
    """Why greedy decoding cannot stand in for ``model.generate(**settings)``; empty if it can."""
    if type(model).__name__ != "LlamaForCausalLM":
        return f"{type(model).__name__} is not a LlamaForCausalLM"
    config = model.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope type {rope.get('rope_type')!r}"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "biases in attention or MLP"
    if getattr(config, "hidden_act", "silu") != "silu" or (getattr(config, "pretraining_tp", 1) or 1) != 1:
        return f"hidden_act={config.hidden_act!r}, pretraining_tp={config.pretraining_tp}"
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention != "sdpa":  # the same attention kernel as the model's, for the same rounding
        return f"attention implementation {attention!r} (this loop runs sdpa's)"
    generation = getattr(model, "generation_config", None)
    effective = {**(generation.to_diff_dict() if generation is not None else {}), **settings}
    other = sorted(k for k in effective if k not in _GREEDY_SETTINGS)
    if other:
        return f"settings beyond greedy decoding: {other}"
    if effective.get("do_sample") or (effective.get("num_beams") or 1) != 1:
        return "sampling or beam search"
    if not isinstance(settings.get("max_new_tokens"), int):
        return "no max_new_tokens"
    return ""
