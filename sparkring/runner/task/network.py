"""Where a task is on the network: its address, the interface that carries it, free ports on it."""
from __future__ import annotations

import socket
from typing import List, Optional


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


def free_ports(ip: str, count: int = 1) -> List[int]:
    """``count`` distinct ports free on ``ip`` (held open together while they are chosen)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    socks = [socket.socket(family) for _ in range(count)]
    try:
        for s in socks:
            s.bind((ip, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
