"""The environment contract between the runner and a rank: every SPARKRING_* name, and
``RankEnv``, the rank's place in the ring as a type that the runner writes (``to_env``) and
``collective.init()``, the worker and ``report()`` read (``from_env``)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

from ..process_start import START_VARIABLE

if TYPE_CHECKING:
    import torch

RANK = "SPARKRING_RANK"
SIZE = "SPARKRING_SIZE"
LOCAL_RANK = "SPARKRING_LOCAL_RANK"
LOCAL_SIZE = "SPARKRING_LOCAL_SIZE"
CROSS_RANK = "SPARKRING_CROSS_RANK"
CROSS_SIZE = "SPARKRING_CROSS_SIZE"
MASTER_ADDR = "SPARKRING_MASTER_ADDR"
MASTER_PORT = "SPARKRING_MASTER_PORT"
BACKEND = "SPARKRING_BACKEND"
TIMEOUT = "SPARKRING_COLLECTIVE_TIMEOUT"
START_TIMEOUT = "SPARKRING_START_TIMEOUT"
DRIVER = "SPARKRING_DRIVER"            # host:port of the live channel (absent when detached)
SECRET = "SPARKRING_SECRET"            # the run's HMAC key, hex
ATTEMPT = "SPARKRING_ATTEMPT"          # the stage attempt's key
EVENT_FILE = "SPARKRING_EVENT_FILE"    # where reports go when the driver is out of reach
PARENT_PID = "SPARKRING_PARENT_PID"    # the task process the worker dies with
WORKER_START = START_VARIABLE          # fork | spawn (sparkring.process_start decides)
SHM = "SPARKRING_SHM"                  # 0: allreduce between ranks of one host through gloo, not shared memory
GPU = "SPARKRING_GPU"                  # the CUDA ordinal of this rank's GPU (in its CUDA_VISIBLE_DEVICES)
HOST_ID = "SPARKRING_HOST_ID"          # the host an executor is on, where its address does not tell
TIMELINE = "SPARKRING_TIMELINE"        # run()/CLI: write a Chrome-trace timeline of the ranks here
HOROVOD_TIMELINE = "HOROVOD_TIMELINE"  # Horovod's name for the same
ELASTIC_DIR = "SPARKRING_ELASTIC_DIR"  # run(min_proc=...): where rank 0 persists commits and the driver asks to stop

DEFAULT_TIMEOUT_S = 1800.0             # a collective's limit without a runner (gloo's own default)

# field of RankEnv -> its variable; one table, so to_env and from_env cannot disagree
_NAMES = {
    "rank": RANK, "size": SIZE, "local_rank": LOCAL_RANK, "local_size": LOCAL_SIZE,
    "cross_rank": CROSS_RANK, "cross_size": CROSS_SIZE, "master_addr": MASTER_ADDR,
    "master_port": MASTER_PORT, "backend": BACKEND, "timeout": TIMEOUT, "start_timeout": START_TIMEOUT,
    "driver": DRIVER, "secret": SECRET, "attempt": ATTEMPT, "event_file": EVENT_FILE,
    "parent_pid": PARENT_PID, "gpu": GPU,
}


@dataclass(frozen=True)
class RankEnv:
    """Where a rank stands in its ring and how it reaches the others and the driver.

    Unset fields (None) are absent from the environment: ``local_rank``/``local_size`` then come
    from the backend (``mpirun`` without sparkring), the timeouts from ``DEFAULT_TIMEOUT_S``.
    ``torch_port`` is torchrun's MASTER_PORT, a port of its own beside sparkring's store.

    >>> env = RankEnv(rank=1, size=2, master_addr="127.0.0.1", master_port=29500, torch_port=29501).to_env()
    >>> env["SPARKRING_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]
    ('1', '2', '29501')
    >>> RankEnv.from_env(env).master_port
    29500
    """

    rank: int = 0
    size: int = 1
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    cross_rank: int = 0
    cross_size: int = 1
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    backend: str = "auto"
    timeout: Optional[float] = None
    start_timeout: Optional[float] = None
    driver: Optional[str] = None         # host:port of the live channel
    secret: Optional[str] = None         # hex
    attempt: int = 0
    event_file: Optional[str] = None
    parent_pid: Optional[int] = None
    gpu: Optional[int] = None
    torch_port: Optional[int] = None     # not read back: torchrun's variables carry it
    run_id: str = "0"

    @property
    def collective_timeout(self) -> float:
        """Seconds a collective may wait for the other ranks (the fit's timeout, else the default)."""
        return self.timeout if self.timeout is not None else DEFAULT_TIMEOUT_S

    @property
    def rendezvous_timeout(self) -> float:
        """Seconds the ranks may take to meet (the start timeout, else the collective timeout)."""
        return self.start_timeout if self.start_timeout is not None else self.collective_timeout

    def to_env(self) -> Dict[str, str]:
        """SPARKRING_* for every set field, plus torchrun's variables when ``torch_port`` is set."""
        env = {name: str(getattr(self, field)) for field, name in _NAMES.items() if getattr(self, field) is not None}
        if self.torch_port is not None and self.master_addr is not None:
            env.update(torchrun_env(rank=self.rank, size=self.size, local_rank=self._local_rank,
                                    local_size=self._local_size, node_rank=self.cross_rank,
                                    nodes=self.cross_size, master_addr=self.master_addr,
                                    master_port=self.torch_port, run_id=self.run_id))
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "RankEnv":
        """The rank's place as the runner wrote it (defaults: a ring of one)."""
        values: Dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            name = _NAMES.get(f.name)
            if name is None or not env.get(name):
                continue
            kind = f.type.replace("Optional[", "").rstrip("]")
            raw = env[name]
            values[f.name] = int(raw) if kind == "int" else float(raw) if kind == "float" else raw
        return cls(**values)

    @property
    def _local_rank(self) -> int:
        return self.rank if self.local_rank is None else self.local_rank

    @property
    def _local_size(self) -> int:
        return self.size if self.local_size is None else self.local_size


def rank_device(use_gpu: bool = True) -> "torch.device":
    """The device this rank computes on, decided here only: with ``use_gpu`` and CUDA, the GPU the
    runner gave it (``SPARKRING_GPU``, an ordinal in its CUDA_VISIBLE_DEVICES; else the current
    one), otherwise the CPU.

    Arguments:
        use_gpu: False forces the CPU.

    Returns:
        A ``torch.device``: this rank's GPU, or the CPU.

    >>> rank_device(use_gpu=False)
    device(type='cpu')
    """
    import torch

    if use_gpu and torch.cuda.is_available():
        gpu = RankEnv.from_env().gpu
        return torch.device("cuda", torch.cuda.current_device() if gpu is None else gpu)
    return torch.device("cpu")


def in_a_run(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is a rank the runner started (it set the rank's variables)."""
    return RANK in env


def torchrun_env(rank: int, size: int, local_rank: int, local_size: int, node_rank: int, nodes: int,
                 master_addr: str, master_port: int, run_id: str) -> Dict[str, str]:
    """The variables torchrun (torch.distributed.run) gives each process, so that scripts
    written for it (``init_process_group(init_method="env://")``, code reading LOCAL_RANK or
    GROUP_RANK) run unchanged. MASTER_PORT is a port of its own, not sparkring's store.

    >>> torchrun_env(0, 2, 0, 2, 0, 1, "127.0.0.1", 29501, "0")["LOCAL_WORLD_SIZE"]
    '2'
    """
    return {
        "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(node_rank), "NODE_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(size),
        "ROLE_NAME": "default", "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
