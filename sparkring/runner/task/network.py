"""Where a task is on the network: its address, the interface that carries it, free ports on it
(collective.ports chooses them)."""
from __future__ import annotations

import socket
from typing import Optional

from ...collective.ports import free_ports

__all__ = ["free_ports", "interface_of", "resolve"]


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
