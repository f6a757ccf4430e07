"""The task side of the runner: the body of one barrier task, the rank's worker process and how
it starts and is supervised. Imports only the shared modules of ``sparkring.runner`` (protocol,
channel, gpus, versions, failures), never the driver side."""
