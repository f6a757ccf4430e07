"""What a GPU address Spark assigned means to CUDA, decided one way for the ranks'
CUDA_VISIBLE_DEVICES and ordinal and for transform()'s device.

Spark's addresses are whatever the discovery script printed: physical indices
(``nvidia-smi --query-gpu=index``), UUIDs (``GPU-…``) or MIG instances (``MIG-…``). Where the
resource manager already set CUDA_VISIBLE_DEVICES on the executor (YARN, Kubernetes device
plugins, Slurm), an address is either one of those entries or an index into them (a script
that enumerates through CUDA). Written by hand: neither Spark nor torch maps one to the other.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

from ..errors import ConfigurationError

VISIBLE = "CUDA_VISIBLE_DEVICES"
log = logging.getLogger(__name__)


def preset_devices(environ: Mapping[str, str] = os.environ) -> Optional[List[str]]:
    """The entries of a CUDA_VISIBLE_DEVICES already set on this executor, or None.

    >>> preset_devices({"CUDA_VISIBLE_DEVICES": "2, 3"})
    ['2', '3']
    """
    value = environ.get(VISIBLE)
    if value is None or not value.strip():
        return None
    return [entry.strip() for entry in value.split(",") if entry.strip()]


def cuda_names(addresses: Sequence[str], environ: Mapping[str, str] = os.environ) -> List[str]:
    """Spark's GPU addresses as CUDA_VISIBLE_DEVICES entries for a process started from
    ``environ`` (what the executor's own CUDA_VISIBLE_DEVICES, if any, calls them).

    >>> cuda_names(["0", "1"], {})
    ['0', '1']
    >>> cuda_names(["1"], {"CUDA_VISIBLE_DEVICES": "4,5"})  # an index into the preset list
    ['5']
    >>> cuda_names(["GPU-8a1f"], {"CUDA_VISIBLE_DEVICES": "GPU-77c2,GPU-8a1f"})
    ['GPU-8a1f']
    """
    preset = preset_devices(environ)
    names = []
    for address in addresses:
        name = str(address).strip()
        if preset is None or name in preset:
            names.append(name)
        elif name.isdigit() and int(name) < len(preset):
            names.append(preset[int(name)])
        else:
            raise ConfigurationError(
                f"Spark assigned GPU address {name!r}, which is neither one of this executor's "
                f"CUDA_VISIBLE_DEVICES={','.join(preset)} nor an index into it: make "
                "spark.executor.resource.gpu.discoveryScript print the GPUs this executor can see")
    return names


@dataclass(frozen=True)
class HostGpus:
    """The GPUs of the ranks on one host, as every one of them sees them.

    ``visible`` is the CUDA_VISIBLE_DEVICES all ranks of the host share: each local rank's
    first GPU in local-rank order (so Horovod's ``torch.cuda.set_device(hvd.local_rank())``
    picks the rank's own GPU), then any further GPUs of multi-GPU tasks. ``ordinals[i]`` is
    local rank i's GPU in that numbering.

    >>> host_gpus([["3"], ["1"]])
    HostGpus(visible=('3', '1'), ordinals=(0, 1), shared=False)
    """

    visible: Tuple[str, ...]
    ordinals: Tuple[int, ...]
    shared: bool                    # two ranks of the host were given the same GPU


def host_gpus(per_local_rank: Sequence[Sequence[str]]) -> HostGpus:
    """Combine the GPU names of a host's ranks, ordered by local rank.

    >>> host_gpus([["0"], ["0"]]).shared  # half a GPU per task
    True
    """
    if any(not names for names in per_local_rank):
        missing = [i for i, names in enumerate(per_local_rank) if not names]
        raise ConfigurationError(f"local rank(s) {missing} were given no GPU although the run uses GPUs: "
                                 "set spark.task.resource.gpu.amount so Spark assigns one to every task")
    firsts = [names[0] for names in per_local_rank]
    rest = [name for names in per_local_rank for name in names[1:]]
    visible = tuple(dict.fromkeys(firsts + rest))
    owners = [name for names in per_local_rank for name in dict.fromkeys(names)]
    return HostGpus(visible=visible, ordinals=tuple(visible.index(f) for f in firsts),
                    shared=len(owners) != len(set(owners)))


def device_ordinal(address: str, environ: Mapping[str, str] = os.environ,
                   uuids: Optional[Callable[[], List[str]]] = None) -> int:
    """The torch CUDA ordinal, in a process started from ``environ``, of Spark's GPU ``address``.

    ``uuids()`` lists "GPU-…" names of the devices torch sees (looked up only for a UUID
    address where no CUDA_VISIBLE_DEVICES is preset).

    >>> device_ordinal("5", {"CUDA_VISIBLE_DEVICES": "4,5"})
    1
    >>> device_ordinal("2", {})
    2
    """
    name = cuda_names([address], environ)[0]
    preset = preset_devices(environ)
    if preset is not None:
        return preset.index(name)
    if name.isdigit():
        return int(name)
    known = (uuids or torch_uuids)()
    if name in known:
        return known.index(name)
    raise ConfigurationError(f"Spark assigned GPU {name!r}, which torch does not see on this executor (it sees "
                             f"{known}); set CUDA_VISIBLE_DEVICES on the executors or make the discovery "
                             "script print device indices")


def torch_uuids() -> List[str]:
    """The "GPU-…" UUID of each CUDA device torch sees, by ordinal."""
    import torch

    return [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(torch.cuda.device_count())]


def discover_gpus(script: Optional[str]) -> Tuple[str, ...]:
    """Run a Spark GPU discovery script (prints ``{"name": "gpu", "addresses": [...]}``)."""
    if not script:
        return ()
    try:
        out = subprocess.run([script], capture_output=True, text=True, timeout=60, check=True).stdout
        return tuple(str(a) for a in json.loads(out).get("addresses", []))
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        log.warning("GPU discovery script %s failed: %s", script, exc)
        return ()


SHARED_GPU_FALLBACK = ("ranks on one host share a GPU, which NCCL refuses: backend='auto' uses gloo; give every task a "
                       "whole GPU (spark.task.resource.gpu.amount=1) for NCCL")


def backend_on_shared_gpus(backend: str, from_auto: bool, where: str, name: str = "backend", why: str = "") -> str:
    """The backend where ranks share a GPU, decided one way by the launch plan (from the session's
    GPU amounts) and by the tasks (from the GPUs they were given): NCCL asked for is refused,
    NCCL that ``backend="auto"`` chose falls back to gloo.

    >>> backend_on_shared_gpus("nccl", from_auto=True, where="ranks on host a")
    'gloo'
    """
    if backend != "nccl":
        return backend
    if not from_auto:
        raise ConfigurationError(f"{name}='nccl' but {where} share a GPU{why}, which NCCL refuses (\"Duplicate GPU "
                                 f"detected\"): give every task a whole GPU, or use {name}='gloo'")
    log.warning(SHARED_GPU_FALLBACK)
    return "gloo"
