"""Where a task is on the network: its address and the interface that carries it (the free ports
on it: collective/ports.py)."""
from __future__ import annotations

import socket
from typing import Optional


def resolve(host: str) -> str:
    """``host``'s IPv4 address (the name itself where it does not resolve)."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def interface_of(ip: str) -> Optional[str]:
    """Name of the network interface that holds ``ip`` (gloo/nccl bind to it)."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == ip for a in addrs):
                return name
    except Exception:  # noqa: BLE001 - best effort; the library default applies
        pass
    return None
