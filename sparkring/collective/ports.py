"""Ports a ring's rendezvous listens on: free ones, chosen below the kernel's ephemeral range.

A port the kernel hands out for ``bind(ip, 0)`` comes from the ephemeral range, the same range it
hands out to every outgoing connection and to every other ``bind(ip, 0)`` (MPICH's launcher, Spark's
RPC); between choosing a port and listening on it, another process may take it there ("Address
already in use"). Below that range only a process naming the same port explicitly can."""
from __future__ import annotations

import random
import socket
from typing import List, Optional

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000  # below: the well-known ports of services (Spark's 4040, 7077, 8080, ...)
TRIES = 200


def _ephemeral_start() -> Optional[int]:
    """The first port of the kernel's ephemeral range (None where the kernel does not say)."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_ports(ip: str, count: int = 1) -> List[int]:
    """``count`` distinct ports free on ``ip`` (held open together while they are chosen), below the
    ephemeral range where it leaves room, else where the kernel picks.

    >>> len(set(free_ports("127.0.0.1", 2)))
    2
    """
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    start = _ephemeral_start()
    below = range(LOWEST_PORT, start) if start is not None and start - LOWEST_PORT >= 1000 else range(0)
    socks: List[socket.socket] = []
    try:
        for port in random.sample(below, min(TRIES, len(below))):
            if len(socks) == count:
                break
            sock = socket.socket(family)
            try:
                sock.bind((ip, port))
                socks.append(sock)
            except OSError:
                sock.close()
        while len(socks) < count:
            sock = socket.socket(family)
            socks.append(sock)
            sock.bind((ip, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()
