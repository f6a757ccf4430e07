"""Adasum: adaptive summation of gradients (Maleki et al., "Scaling Distributed Training
with Adaptive Summation", MLSys 2021), over a recursive-doubling exchange.

Written by hand: torch.distributed has no Adasum reduction.
"""
from __future__ import annotations

import torch

from ._backend import Backend


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a*(1 - a.b/(2|a|^2)) + b*(1 - a.b/(2|b|^2)); zero vectors combine as a plain sum.

    >>> adasum_pair(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))  # orthogonal: a + b
    tensor([1., 1.])
    >>> adasum_pair(torch.tensor([2.0]), torch.tensor([2.0]))  # identical: their average
    tensor([2.])
    """
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    dot = torch.dot(a64, b64)
    na, nb = torch.dot(a64, a64), torch.dot(b64, b64)
    ca = 1 - dot / (2 * na) if na > 0 else torch.tensor(1.0, dtype=torch.float64)
    cb = 1 - dot / (2 * nb) if nb > 0 else torch.tensor(1.0, dtype=torch.float64)
    return (ca * a64 + cb * b64).to(a.dtype).reshape(a.shape)


def adasum_allreduce(tensor: torch.Tensor, backend: Backend) -> torch.Tensor:
    """Every rank gets the Adasum of all ranks' tensors: at level k, rank r combines with
    rank r ^ 2^k (the lower rank's tensor first, so both sides compute the same value)."""
    size, rank = backend.size, backend.rank
    if size & (size - 1):
        raise ValueError(f"op=Adasum needs a power-of-two number of ranks; this ring has {size}")
    current = tensor.detach().clone()
    distance = 1
    while distance < size:
        partner = rank ^ distance
        theirs = torch.empty_like(current)
        if rank < partner:
            backend.send(current, partner)
            backend.recv(theirs, partner)
            current = adasum_pair(current, theirs)
        else:
            backend.recv(theirs, partner)
            backend.send(current, partner)
            current = adasum_pair(theirs, current)
        distance *= 2
    return current
