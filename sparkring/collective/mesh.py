"""A torch DeviceMesh over the ring inside a rank: 1-D and hybrid for FSDP2, (pp, dp, tp) for model parallelism."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from . import _runtime, basics

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_meshes: Dict[Tuple[bool, int, int, int], "DeviceMesh"] = {}  # once per ring and form: a mesh makes process groups


def device_mesh(hybrid: bool = False, *, dp: Optional[int] = None, tp: int = 1, pp: int = 1) -> "DeviceMesh":
    """The ring as a DeviceMesh on the backend's device type. Every rank calls it, with the same arguments.

    - ``device_mesh()``: 1-D over every rank, named ``"shard"`` (FSDP2).
    - ``device_mesh(hybrid=True)``: 2-D hosts x local ranks, ``("replicate", "shard")`` (HSDP).
    - ``device_mesh(tp=..., pp=..., dp=...)``: 3-D ``("pp", "dp", "tp")``, tp innermost: the ranks of
      one tensor-parallel group are consecutive local ranks of one host (so their collectives stay
      inside it, over NVLink where there is one); ``dp`` defaults to ``size() // (tp * pp)``.

    Arguments:
        hybrid: a 2-D mesh, hosts x local ranks, instead of one dimension over every rank.
        dp: data-parallel ranks (the dimension FSDP2 shards over, or gradients are averaged over).
        tp: ranks of each tensor-parallel group (each must divide the ranks of every host).
        pp: pipeline stages.
    Returns:
        A ``torch.distributed.device_mesh.DeviceMesh`` over the ring (made once per form and ring);
        ``mesh["tp"]`` and ``mesh["dp"]`` are its 1-D submeshes.

    >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    >>> mesh = sr.device_mesh(tp=2)  # doctest: +SKIP
    >>> parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})  # doctest: +SKIP
    """
    backend = _runtime.current()
    key = (hybrid, dp or 0, tp, pp)
    if key in _meshes:
        return _meshes[key]
    if type(backend).__name__ == "MPIBackend":
        raise ValueError("device_mesh() needs torch.distributed collectives (DTensor, FSDP2): use backend='gloo' "
                         "or 'nccl', not 'mpi'")
    from torch.distributed.device_mesh import DeviceMesh

    device = backend.device
    device_type = device.type if device is not None and device.type != "cpu" else "cpu"
    if tp != 1 or pp != 1 or dp is not None:
        if hybrid:
            raise ValueError("device_mesh(hybrid=True) is 2-D hosts x local ranks; with tp= or pp= pass dp= instead")
        mesh = DeviceMesh(device_type, _parallel_layout(backend.size, dp, tp, pp), mesh_dim_names=("pp", "dp", "tp"))
    elif not hybrid:
        mesh = DeviceMesh(device_type, torch.arange(backend.size), mesh_dim_names=("shard",))
    else:
        mesh = DeviceMesh(device_type, torch.tensor(_hosts_by_local_rank()), mesh_dim_names=("replicate", "shard"))
    _meshes[key] = mesh
    return mesh


def _hosts_by_local_rank() -> List[List[int]]:
    """Every rank placed at [its host][its local rank]; refused unless every host has as many ranks."""
    places = _runtime.gather_objects((basics.cross_rank(), basics.local_rank()))
    hosts, per_host = basics.cross_size(), basics.local_size()
    layout = [[-1] * per_host for _ in range(hosts)]
    for rank, (host, local) in enumerate(places):
        if host >= hosts or local >= per_host:
            raise ValueError(f"device_mesh(hybrid=True) needs the same number of ranks on every host; rank {rank} "
                             f"is local rank {local} of host {host}, but hosts have {per_host} ranks")
        layout[host][local] = rank
    if any(r < 0 for row in layout for r in row):
        raise ValueError("device_mesh(hybrid=True) needs the same number of ranks on every host")
    return layout


def _parallel_layout(size: int, dp: Optional[int], tp: int, pp: int) -> torch.Tensor:
    """The ranks as a (pp, dp, tp) tensor: ordered by host, then local rank, so that each run of
    ``tp`` consecutive ranks (a tensor-parallel group) lies inside one host."""
    if tp < 1 or pp < 1 or size % (tp * pp):
        raise ValueError(f"device_mesh: tp={tp} x pp={pp} must divide the {size} ranks of the ring")
    dp = size // (tp * pp) if dp is None else dp
    if dp * tp * pp != size:
        raise ValueError(f"device_mesh: dp={dp} x tp={tp} x pp={pp} is {dp * tp * pp}, not the ring's {size} ranks")
    places = _runtime.gather_objects((basics.cross_rank(), basics.local_rank()))
    per_host: Dict[int, int] = {}
    for host, _local in places:
        per_host[host] = per_host.get(host, 0) + 1
    split = {host: n for host, n in per_host.items() if n % tp}
    if split:
        raise ValueError(f"device_mesh: tp={tp} must divide the ranks of every host (a tensor-parallel group never "
                         f"spans hosts), but host(s) {sorted(split)} have {sorted(set(split.values()))} rank(s)")
    # hosts in the order of their first rank, each host's ranks in rank order: torch numbers a mesh
    # dimension's process group in rank order, so every dimension must list its ranks ascending
    first = {host: min(r for r in range(size) if places[r][0] == host) for host in per_host}
    layout = torch.tensor(sorted(range(size), key=lambda r: (first[places[r][0]], r))).reshape(pp, dp, tp)
    for dim, name in enumerate(("pp", "dp", "tp")):
        rows = layout.movedim(dim, -1).reshape(-1, layout.shape[dim])
        if any(row.tolist() != sorted(row.tolist()) for row in rows):
            raise ValueError(f"device_mesh: the ranks' hosts ({[places[r][0] for r in range(size)]} by rank) give no "
                             f"layout whose {name} groups run in rank order, which torch's process groups need; "
                             "place consecutive ranks on one host (one task per slot, hosts filled in turn)")
    return layout


_runtime.on_new_ring(lambda _backend: _meshes.clear())
