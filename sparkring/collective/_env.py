"""The environment contract between the runner (which sets it) and a rank (collective.init(),
the worker, reports to the driver): every SPARKRING_* name, in one place."""
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
WORKER_START = "SPARKRING_WORKER_START"  # fork | spawn
