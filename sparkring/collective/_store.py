"""The rendezvous key-value store: a torch TCPStore hosted by rank 0 on its own address only.

TCPStore's server listens on every interface when it opens its own socket; handing it a
socket already bound to the master address keeps it off every other network."""
from __future__ import annotations

import datetime
import socket
import time

import torch.distributed as dist


def rendezvous_store(addr: str, port: int, size: int, rank: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0 hosts the store on ``addr:port``; every other rank connects to it."""
    if rank != 0:
        wait_until_listening(addr, port, timeout.total_seconds())
        return dist.TCPStore(addr, port, size, is_master=False, timeout=timeout, wait_for_workers=False)
    listener = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((addr, port))
    listener.listen(max(128, size))
    # the store owns the descriptor from here on (and closes it)
    return dist.TCPStore(addr, port, size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def client_store(addr: str, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """One more connection to the store (for a thread that blocks on it)."""
    return dist.TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)


def wait_until_listening(addr: str, port: int, timeout_s: float) -> None:
    """Return once rank 0's store accepts connections (or after ``timeout_s``; TCPStore then
    says what is wrong). Ranks start together, so a client usually asks before the store
    listens, and TCPStore's own retry backs off for up to a second; polling here costs
    milliseconds."""
    deadline = time.monotonic() + timeout_s
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    while time.monotonic() < deadline:
        with socket.socket(family) as probe:
            probe.settimeout(1.0)
            if probe.connect_ex((addr, port)) == 0:
                return
        time.sleep(0.005)
