"""Weights written to storage as safetensors: one file, or shards named in an index (Hugging Face's
layout, model.safetensors.index.json) above a size, each tensor stored once where a model ties two names;
from one rank's whole state, or from a sharded model by every rank, each writing its own files.

The spread writer is by hand: DCP's ``HuggingFaceStorageWriter`` writes each rank's slices and
consolidates them in a second pass over the files, where here each whole tensor is put together once
(one collective) on the rank whose file holds it, so a rank holds its file's tensors and no more."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Callable, Dict, List, Optional, Sequence, Tuple

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


def shard_names(count: int) -> List[str]:
    """Hugging Face's file names for ``count`` files of weights.

    >>> shard_names(2)
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    return [WEIGHTS] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_file(store, directory: str, name: str, part: Dict[str, torch.Tensor],
               metadata: Optional[Dict[str, str]] = None) -> None:
    """Write ``part`` as the safetensors file ``name`` in ``directory`` of ``store`` (local or an object store)."""
    from safetensors.torch import save_file

    meta = {"format": "pt", **(metadata or {})}
    local = store.local_path(directory)
    if local is not None:
        save_file(part, os.path.join(local, name), metadata=meta)
        return
    with tempfile.TemporaryDirectory() as tmp:  # an object store takes a file in one PUT
        save_file(part, os.path.join(tmp, name), metadata=meta)
        with open(os.path.join(tmp, name), "rb") as f:
            store.write_bytes(f"{directory}/{name}", f.read())


def write_index(store, directory: str, files: Sequence[Tuple[str, Sequence[str]]], total_bytes: int) -> None:
    """Hugging Face's index of the files (each file's name and its tensors' names) in ``directory``."""
    index = {"metadata": {"total_size": total_bytes},
             "weight_map": {tensor: name for name, tensors in files for tensor in tensors}}
    store.write_bytes(f"{directory}/{SAFETENSORS_INDEX}", json.dumps(index, indent=2).encode())


def write_safetensors(store, directory: str, state: Dict[str, torch.Tensor], max_bytes: int = SHARD_BYTES,
                      metadata: Optional[Dict[str, str]] = None) -> List[str]:
    """Write ``state`` into ``directory`` of ``store`` (a Store) as ``model.safetensors``, or as
    ``model-0000i-of-0000n.safetensors`` with Hugging Face's index where it exceeds ``max_bytes``;
    the names of the files written.

    >>> write_safetensors(Store("/tmp/out"), "/tmp/out/model", model.state_dict())  # doctest: +SKIP
    ['model.safetensors']
    """
    parts = shards(distinct_tensors(state), max_bytes)
    names = shard_names(len(parts))
    store.makedirs(directory)
    for name, part in zip(names, parts):
        write_file(store, directory, name, part, metadata)
    if len(parts) > 1:
        write_index(store, directory, [(name, list(part)) for name, part in zip(names, parts)],
                     sum(t.numel() * t.element_size() for p in parts for t in p.values()))
    return names


def clear(store, directory: str) -> None:
    """Remove what an earlier fit of the run wrote in ``directory`` (a stale index would name its files)."""
    if store.exists(directory):
        store.delete(directory)


def spread(sizes: Sequence[Tuple[str, int]], files: int) -> List[List[str]]:
    """The tensors (name, bytes), in order, cut into at most ``files`` runs of about equal bytes.

    >>> spread([("a", 4), ("b", 4), ("c", 8)], 2)
    [['a', 'b'], ['c']]
    """
    total = sum(n for _, n in sizes) or 1
    out: List[List[str]] = [[] for _ in range(max(1, min(files, len(sizes))))]
    done = 0
    for name, nbytes in sizes:
        out[min(len(out) - 1, done * len(out) // total)].append(name)
        done += nbytes
    return [names for names in out if names]


def write_from_every_rank(store, directory: str, sizes: Sequence[Tuple[str, int]],
                          whole: Callable[[str], torch.Tensor], rank: int, world: int,
                          max_bytes: int = SHARD_BYTES) -> List[str]:
    """Write a sharded model's tensors as Hugging Face's files, file ``i`` by rank ``i % world``:
    every rank calls ``whole(name)`` (a collective that puts the tensor together) for every name of
    ``sizes`` (the same on every rank) in order, and keeps only the tensors of its own files; rank 0
    writes the index. The names of the files this rank wrote.

    >>> write_from_every_rank(store, run_dir, [("w", 64)], lambda n: full[n], rank=0, world=1)  # doctest: +SKIP
    ['model.safetensors']
    """
    total = sum(n for _, n in sizes)
    runs = spread(sizes, max(world, -(-total // max_bytes)))
    names = shard_names(len(runs))
    store.makedirs(directory)
    written: List[str] = []
    for i, (name, tensors) in enumerate(zip(names, runs)):
        mine = i % world == rank
        part = {}
        for tensor in tensors:
            value = whole(tensor)
            if mine:
                part[tensor] = value.detach().cpu().contiguous()
            del value
        if mine:
            write_file(store, directory, name, part)
            written.append(name)
        del part
    if rank == 0 and len(runs) > 1:
        write_index(store, directory, list(zip(names, runs)), total)
    return written
