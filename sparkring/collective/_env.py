"""The environment contract between the runner (which sets it) and a rank (collective.init(),
the worker, reports to the driver): every SPARKRING_* name, in one place."""
from ..processes import START_VARIABLE

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
WORKER_START = START_VARIABLE            # fork | spawn (sparkring.processes decides)
SHM = "SPARKRING_SHM"                  # 0: allreduce between ranks of one host through gloo, not shared memory
GPU = "SPARKRING_GPU"                  # the CUDA ordinal of this rank's GPU (in its CUDA_VISIBLE_DEVICES)
HOST_ID = "SPARKRING_HOST_ID"          # the host a rank says it is on (tests simulate several hosts)


def torchrun_env(rank: int, size: int, local_rank: int, local_size: int, node_rank: int, nodes: int,
                 master_addr: str, master_port: int, run_id: str) -> dict:
    """The variables torchrun (torch.distributed.run) gives each process, so that scripts
    written for it (``init_process_group(init_method="env://")``, code reading LOCAL_RANK or
    GROUP_RANK) run unchanged. MASTER_PORT is a port of its own, not sparkring's store."""
    return {
        "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(node_rank), "NODE_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(size),
        "ROLE_NAME": "default", "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
