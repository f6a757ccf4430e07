"""Checks that every rank passes the same tensors: before each collective, ranks agree on its
kind, op, dtype, shape (all but the first dimension for allgather/alltoall), root and name, so a
mismatch raises on every rank, naming both sides, instead of reaching the transport (gloo aborts
the process on mismatched sizes; different broadcast roots deadlock).

The agreement is one small allgather of a fixed-size signature (16 int64) per call, the cost of
a 4 KB allreduce; allgather and alltoall take the first dimensions they need from it, so for
them it is free. DistributedOptimizer's bucket allreduces skip it: their shapes were agreed
once, when the optimizer was built (check_same_shapes)."""
from __future__ import annotations

import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import MismatchError
from . import _runtime

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "broadcast_object", "reducescatter",
         "allgather_object")
# What Horovod refuses while a rank has joined ("... is not supported with Join at this time");
# allreduce and barrier go on, with neutral inputs from the joined ranks.
NOT_WITH_JOIN = ("allgather", "broadcast", "alltoall", "broadcast_object", "reducescatter", "allgather_object")
_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64, torch.bool, torch.complex64, torch.complex128)
_OPS = ("", "Average", "Sum", "Min", "Max", "Product", "Adasum")
_MAX_DIMS = 8
_SIG_LEN = 17  # kind, dtype, op, root, ndim, name, dim0, dims 1..8, overflow hash, joined


def _signature(kind: str, tensor: Optional[torch.Tensor], op: str, root: int, name: Optional[str]) -> List[int]:
    sig = [0] * _SIG_LEN
    sig[0] = KINDS.index(kind) + 1
    sig[2] = _OPS.index(op) if op in _OPS else 99
    sig[3] = root
    sig[5] = zlib.crc32(name.encode()) & 0x7FFFFFFF if name else 0
    if tensor is not None:
        sig[1] = _DTYPES.index(tensor.dtype) + 1 if tensor.dtype in _DTYPES else 99
        shape = list(tensor.shape)
        sig[4] = len(shape)
        sig[6] = shape[0] if shape else 1
        for i, d in enumerate(shape[1:1 + _MAX_DIMS]):
            sig[7 + i] = d
        if len(shape) > 1 + _MAX_DIMS:
            sig[15] = zlib.crc32(repr(shape[1 + _MAX_DIMS:]).encode()) & 0x7FFFFFFF
    return sig


def _describe_sig(sig: Sequence[int], free_first: bool) -> str:
    kind = KINDS[sig[0] - 1] if 0 < sig[0] <= len(KINDS) else f"kind#{sig[0]}"
    parts = [kind]
    if sig[1]:
        dims = [sig[6]] + list(sig[7:7 + max(0, sig[4] - 1)])
        shown = ["*" if free_first and i == 0 else str(d) for i, d in enumerate(dims[:sig[4]])]
        dtype = _DTYPES[sig[1] - 1] if sig[1] <= len(_DTYPES) else "dtype#?"
        parts.append(f"shape ({', '.join(shown)}{',' if len(shown) == 1 else ''}) {dtype}")
    if sig[2]:
        parts.append(f"op {_OPS[sig[2]] if sig[2] < len(_OPS) else '?'}")
    if sig[3] >= 0 and kind in ("broadcast", "broadcast_object"):
        parts.append(f"root {sig[3]}")
    return ", ".join(parts)


def agree(kind: str, tensor: Optional[torch.Tensor] = None, op: str = "", root: int = -1,
          name: Optional[str] = None, joined: bool = False) -> List[int]:
    """Every rank's first dimension, once all ranks have checked that they call the same
    collective the same way; raises MismatchError on every rank otherwise.

    >>> firsts = agree("allgather", t, name="emb")  # doctest: +SKIP
    """
    b = _runtime.current()
    sig = _signature(kind, tensor, op, root, name)
    sig[16] = int(joined)
    mine = torch.tensor(sig, dtype=torch.int64)
    if b.size == 1:
        return [int(mine[6])]
    device = b.device
    gathered = b.allgather_same_shape(mine if device is None else mine.to(device))
    rows = [g.cpu().tolist() for g in gathered]
    joined_ranks = [r for r, row in enumerate(rows) if row[16]]
    if joined_ranks and kind in NOT_WITH_JOIN:
        raise MismatchError(f"{kind} is not supported while rank{'s' if len(joined_ranks) > 1 else ''} "
                            f"{', '.join(map(str, joined_ranks))} joined (Horovod raises too): call it before "
                            "join(), or on ranks that all still have data")
    free_first = kind in ("allgather", "alltoall")
    key = (lambda row: row[:6] + row[7:16]) if free_first else (lambda row: row[:16])
    reference = key(rows[0])
    for r, row in enumerate(rows):
        if key(row) != reference:
            label = f"{KINDS[rows[0][0] - 1] if 0 < rows[0][0] <= len(KINDS) else kind}"
            if rows[0][5] != row[5]:
                label += " (the ranks passed different names)"
            raise MismatchError(
                f"mismatched {label}: rank 0 called {_describe_sig(rows[0], free_first)} but rank {r} called "
                f"{_describe_sig(row, free_first)}; every rank must call the same collectives in the same order "
                "with the same dtype, shape" + (" (but the first dimension)" if free_first else "")
                + ", op, root and name")
    return [row[6] for row in rows]


def check_same_shapes(named: List[Tuple[str, torch.Tensor]], what: str) -> None:
    """Raise ValueError naming the rank and tensor when ranks disagree on names, shapes or dtypes.

    >>> sr.check_same_shapes(list(model.named_parameters()), "DistributedOptimizer")  # doctest: +SKIP
    """
    b = _runtime.current()
    if b.size == 1:
        return
    mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
    everyone = _runtime.gather_objects(mine)
    for r, theirs in enumerate(everyone):
        if theirs == mine or theirs is None:  # None: a rank that join()ed sends nothing
            continue
        mine_d = {n: (s, d) for n, s, d in mine}
        theirs_d = {n: (s, d) for n, s, d in theirs}
        for n in sorted(set(mine_d) | set(theirs_d)):
            if mine_d.get(n) != theirs_d.get(n):
                raise ValueError(
                    f"{what}: tensor {n!r} is {_describe(theirs_d.get(n))} on rank {r} but "
                    f"{_describe(mine_d.get(n))} on rank {b.rank}; every rank must pass the same "
                    "names with the same shapes and dtypes")
        raise ValueError(f"{what}: rank {r} passes tensors in a different order than rank {b.rank}")


def _describe(entry) -> str:
    return "missing" if entry is None else f"shape {entry[0]} {entry[1]}"


def forget_names() -> None:
    """A new ring (init after shutdown) starts with no name in flight."""
    in_flight.clear()


in_flight: Dict[str, object] = {}  # names of async operations not synchronized yet


def hold_name(name: Optional[str], handle: object, what: str) -> None:
    """Horovod refuses a second in-flight operation under the same name."""
    if name is None:
        return
    if name in in_flight:
        raise ValueError(f"{what}: an operation named {name!r} is still in flight on rank "
                         f"{_runtime.rank()}; synchronize() it before reusing the name")
    in_flight[name] = handle


def release(handle: object) -> None:
    for name in [n for n, h in in_flight.items() if h is handle]:
        del in_flight[name]


_runtime.on_new_ring(lambda _backend: forget_names())
