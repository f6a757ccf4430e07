"""Checks that every rank passes the same tensors: before each collective, ranks agree on its
kind, op, dtype, shape (all but the first dimension for allgather/alltoall), root and name, so a
mismatch raises on every rank, naming both sides, instead of reaching the transport (gloo aborts
the process on mismatched sizes; different broadcast roots deadlock).

The agreement is one small allgather of a fixed-size signature (18 int64) per call, the cost of
a 4 KB allreduce; allgather and alltoall take the first dimensions they need from it, so for
them it is free. DistributedOptimizer's bucket allreduces skip it: their shapes were agreed
once, when the optimizer was built (check_same_shapes)."""
from __future__ import annotations

import zlib
from typing import List, Optional, Sequence, Tuple

import torch

from ..errors import MismatchError
from . import _pending, _runtime, timeline
from ._join import Recipe

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "broadcast_object", "reducescatter",
         "allgather_object", "barrier", "sync", "add_process_set", "remove_process_set")
SYNC = "sync"  # a rank in synchronize(): it meets the others only to run queued operations (_pending)
# What Horovod refuses while a rank has joined ("... is not supported with Join at this time");
# allreduce and barrier go on, with neutral inputs from the joined ranks.
NOT_WITH_JOIN = ("allgather", "broadcast", "alltoall", "broadcast_object", "reducescatter", "allgather_object")
_SYNC_ID = KINDS.index(SYNC) + 1
_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64, torch.bool, torch.complex64, torch.complex128)
_OPS = ("", "Average", "Sum", "Min", "Max", "Product", "Adasum")
_MAX_DIMS = 8
_SIG_LEN = 18  # kind, dtype, op, root, ndim, name, dim0, dims 1..8, overflow hash, joined, queued
_JOINED, _QUEUED = 16, 17


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
    collective the same way; raises MismatchError on every rank otherwise. Where a rank has
    async operations queued, the ranks first run those every rank queued (``_pending``);
    ``kind="sync"`` (synchronize()) meets the others for that alone. On the timeline it is
    Horovod's negotiation phase (``NEGOTIATE_ALLREDUCE`` ...).

    >>> firsts = agree("allgather", t, name="emb")  # doctest: +SKIP
    """
    recorder = timeline.recorder
    if not recorder.on:
        return _agree(kind, tensor, op, root, name, joined)
    began = recorder.now()
    try:
        return _agree(kind, tensor, op, root, name, joined)
    finally:
        recorder.add(f"NEGOTIATE_{kind.upper()}", began, recorder.now(), timeline.COMM, tensor=name or "")


def _agree(kind: str, tensor: Optional[torch.Tensor], op: str, root: int, name: Optional[str],
           joined: bool) -> List[int]:
    b = _runtime.current()
    sig = _signature(kind, tensor, op, root, name)
    sig[_JOINED] = int(joined)
    if b.size == 1:
        return [sig[6]]
    while True:
        sig[_QUEUED] = 0 if _pending.negotiating() else _pending.count(b)
        seq = _runtime.enter(Recipe("negotiate")) if kind == SYNC else -1
        rows = _gather(b, sig)
        syncing = any(row[0] == _SYNC_ID for row in rows)
        if not syncing and not any(row[_QUEUED] for row in rows):
            break
        progressed, everyone = _pending.run_round(b, joined, _describe_sig(sig, False) + (f" {name!r}" if name else ""))
        _runtime.completed(seq)
        if not syncing and all(row[0] == rows[0][0] for row in rows):
            break  # every rank is at the same collective: check it below
        if not progressed:
            raise MismatchError(_pending.stuck_message(everyone))
        if kind == SYNC:
            return []  # the caller looks at its handle and comes back if it has not run yet
    _check_rows(kind, rows)
    return [row[6] for row in rows]


def _gather(b, sig: List[int]) -> List[List[int]]:
    mine = torch.tensor(sig, dtype=torch.int64)
    device = b.device
    gathered = b.allgather_same_shape(mine if device is None else mine.to(device))
    return [g.cpu().tolist() for g in gathered]


def _check_rows(kind: str, rows: List[List[int]]) -> None:
    joined_ranks = [r for r, row in enumerate(rows) if row[_JOINED]]
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


def agree_shapes(named: List[Tuple[str, torch.Tensor]], what: str) -> None:
    """Raise ValueError naming the rank and tensor when ranks disagree on names, shapes or dtypes
    (functions.check_same_shapes is the public call)."""
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
