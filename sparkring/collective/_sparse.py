"""One exchange for all of a step's sparse gradients: their counts and indices in one
allgather, their values in another (sized from the first, so it needs no size round of its
own), whatever the number of sparse parameters. Horovod allgathers each parameter's indices
and values separately, two rounds each. Dense embeddings remain faster for small tables:
sparse exchange pays off when a step touches a small share of a large table."""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from . import _gather, _reduce, _runtime


def allreduce_sparse_grads(grads: List[torch.Tensor], name: str, op: str) -> List[torch.Tensor]:
    """The sum (or average) over ranks of each sparse COO tensor in ``grads`` (same list, same
    shapes and dtypes on every rank), as sparse tensors.

    >>> emb_grad, = allreduce_sparse_grads([emb.weight.grad], "step", sr.Average)  # doctest: +SKIP
    """
    coalesced = [g.coalesce() for g in grads]
    dtype = coalesced[0].dtype
    if any(g.dtype != dtype for g in coalesced):
        raise ValueError("sparse gradients of different dtypes cannot be fused; exchange them one by one")
    counts = torch.tensor([g._nnz() for g in coalesced], dtype=torch.int64)
    header = torch.cat([counts] + [g.indices().reshape(-1) for g in coalesced])
    values = torch.cat([g.values().reshape(-1) for g in coalesced])
    everyone_header = _gather.allgather_now(header, f"{name}.indices")
    backend = _runtime.current()
    size = backend.size
    sparse_dims = [g.indices().shape[0] for g in coalesced]
    row_elems = [int(torch.Size(g.shape[g.sparse_dim():]).numel()) for g in coalesced]
    # every rank's value count, read from the headers: the values need no size exchange
    lengths, h = [], 0
    for _ in range(size):
        nnz = everyone_header[h:h + len(coalesced)].tolist()
        lengths.append(sum(n * e for n, e in zip(nnz, row_elems)))
        h += len(coalesced) + sum(n * d for n, d in zip(nnz, sparse_dims))
    wire = _reduce.to_wire(values)
    padded = torch.zeros(max(lengths), dtype=wire.dtype, device=wire.device)
    padded[:wire.numel()] = wire
    parts = backend.allgather_same_shape(padded)
    everyone_values = torch.cat([part[:n] for part, n in zip(parts, lengths)]).to(values.device, values.dtype)
    indices_of: List[List[torch.Tensor]] = [[] for _ in coalesced]
    values_of: List[List[torch.Tensor]] = [[] for _ in coalesced]
    h = v = 0
    for _ in range(size):
        nnz = everyone_header[h:h + len(coalesced)].tolist()
        h += len(coalesced)
        for p, n in enumerate(nnz):
            indices_of[p].append(everyone_header[h:h + sparse_dims[p] * n].reshape(sparse_dims[p], n))
            h += sparse_dims[p] * n
            values_of[p].append(everyone_values[v:v + row_elems[p] * n].reshape((n,) + tuple(
                coalesced[p].shape[coalesced[p].sparse_dim():])))
            v += row_elems[p] * n
    out = []
    for p, g in enumerate(coalesced):
        vals = torch.cat(values_of[p])
        if op == _reduce.Average:
            vals = vals / size
        out.append(torch.sparse_coo_tensor(torch.cat(indices_of[p], dim=1), vals, g.shape))
    return out


def allreduce_one(tensor: torch.Tensor, name: Optional[str], op: str) -> Callable[[], torch.Tensor]:
    """Horovod's sparse allreduce of one tensor: its indices and values allgathered now; the
    returned callable (the handle ``synchronize`` calls) builds the sparse sum or average."""
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = _gather.allgather_now(t.indices().transpose(0, 1).contiguous(), f"{name}.indices" if name else None)
    values = _gather.allgather_now(t.values(), f"{name}.values" if name else None)
    size = _runtime.current().size

    def handle() -> torch.Tensor:
        reduced = values / size if op == _reduce.Average else values
        return torch.sparse_coo_tensor(indices.transpose(0, 1), reduced, t.size())

    return handle
