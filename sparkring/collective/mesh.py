"""A torch DeviceMesh over the ring, for FSDP2 (``fully_shard``) and DTensor inside a rank."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict

import torch

from . import _runtime, basics

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_meshes: Dict[bool, "DeviceMesh"] = {}  # made once per ring: a mesh makes process groups (a collective)


def device_mesh(hybrid: bool = False) -> "DeviceMesh":
    """The ring as a DeviceMesh on the backend's device type: 1-D (``"shard"``), or with
    ``hybrid=True`` 2-D hosts x local ranks (``("replicate", "shard")``, for HSDP). Every rank calls it.

    Arguments:
        hybrid: a 2-D mesh, hosts x local ranks, instead of one dimension over every rank.
    Returns:
        A ``torch.distributed.device_mesh.DeviceMesh`` over the ring (made once per form and ring).

    >>> from torch.distributed.fsdp import fully_shard
    >>> mesh = sr.device_mesh()  # doctest: +SKIP
    >>> for layer in model.layers: fully_shard(layer, mesh=mesh)  # doctest: +SKIP
    """
    backend = _runtime.current()
    if hybrid in _meshes:
        return _meshes[hybrid]
    if type(backend).__name__ == "MPIBackend":
        raise ValueError("device_mesh() needs torch.distributed collectives (DTensor, FSDP2): use backend='gloo' "
                         "or 'nccl', not 'mpi'")
    from torch.distributed.device_mesh import DeviceMesh

    device = backend.device
    device_type = device.type if device is not None and device.type != "cpu" else "cpu"
    if not hybrid:
        mesh = DeviceMesh(device_type, torch.arange(backend.size), mesh_dim_names=("shard",))
    else:
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
        mesh = DeviceMesh(device_type, torch.tensor(layout), mesh_dim_names=("replicate", "shard"))
    _meshes[hybrid] = mesh
    return mesh


_runtime.on_new_ring(lambda _backend: _meshes.clear())
