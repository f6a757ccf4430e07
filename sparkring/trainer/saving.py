"""Weights written to storage as safetensors: one file, or shards named in an index (Hugging Face's
layout, model.safetensors.index.json) above a size, each tensor stored once where a model ties two names."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Dict, List, Optional

import torch

from .stored import SAFETENSORS_INDEX

WEIGHTS = "model.safetensors"
SHARD_BYTES = 5 * 2 ** 30  # transformers' own default shard size


def distinct_tensors(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``state`` with each shared tensor once (under its first name), contiguous, on the CPU: what
    safetensors stores (a tied embedding's second name is tied again when the model is built).

    >>> w = torch.ones(2, 2); sorted(distinct_tensors({"a": w, "b": w, "c": torch.zeros(1)}))
    ['a', 'c']
    """
    seen, out = set(), {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().cpu().contiguous()
    return out


def shards(state: Dict[str, torch.Tensor], max_bytes: int = SHARD_BYTES) -> List[Dict[str, torch.Tensor]]:
    """The tensors in files of at most ``max_bytes`` each (a larger tensor alone in its file), in order.

    >>> [sorted(s) for s in shards({"a": torch.zeros(4), "b": torch.zeros(4)}, max_bytes=16)]
    [['a'], ['b']]
    """
    out: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > max_bytes:
            out.append({})
            size = 0
        out[-1][name] = tensor
        size += nbytes
    return out


def write_safetensors(store, directory: str, state: Dict[str, torch.Tensor], max_bytes: int = SHARD_BYTES,
                      metadata: Optional[Dict[str, str]] = None) -> List[str]:
    """Write ``state`` into ``directory`` of ``store`` (a Store) as ``model.safetensors``, or as
    ``model-0000i-of-0000n.safetensors`` with Hugging Face's index where it exceeds ``max_bytes``;
    the names of the files written.

    >>> write_safetensors(Store("/tmp/out"), "/tmp/out/model", model.state_dict())  # doctest: +SKIP
    ['model.safetensors']
    """
    from safetensors.torch import save_file

    parts = shards(distinct_tensors(state), max_bytes)
    names = ([WEIGHTS] if len(parts) == 1 else
             [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))])
    store.makedirs(directory)
    local = store.local_path(directory)
    for name, part in zip(names, parts):
        meta = {"format": "pt", **(metadata or {})}
        if local is not None:
            save_file(part, os.path.join(local, name), metadata=meta)
            continue
        with tempfile.TemporaryDirectory() as tmp:  # an object store takes a file in one PUT
            save_file(part, os.path.join(tmp, name), metadata=meta)
            with open(os.path.join(tmp, name), "rb") as f:
                store.write_bytes(f"{directory}/{name}", f.read())
    if len(parts) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for p in parts for t in p.values())},
                 "weight_map": {t: name for name, part in zip(names, parts) for t in part}}
        store.write_bytes(f"{directory}/{SAFETENSORS_INDEX}", json.dumps(index, indent=2).encode())
    return names
