"""Each host's link to the driver, measured as a fit across several hosts starts: one rank a host,
one host after another, sends ``PROBE_BYTES`` to the driver and times them until the driver says
they arrived (``runner.measure_link``); the driver names a host whose link is far slower than the
others' (estimator/links.py).

Written here because no library measures it, and the ranks' own figures cannot: a ring allreduce
moves at its slowest link on every rank alike, so every rank's communication time is the same
whichever host is slow; each host's link to a third party, the driver, is its own.

>>> probe_links()  # on every rank, after the ring is joined  # doctest: +SKIP
True
"""
from __future__ import annotations

import socket

import sparkring.collective as sr
from sparkring.collective.timeline import recorder
from sparkring.runner import measure_link, report

from .events import LinkMeasured, to_payload

PROBE_BYTES = 8 << 20  # 67 ms at 1 Gbit/s: long enough to see the link, short beside a fit


def probe_links(probe_bytes: int = PROBE_BYTES) -> bool:
    """On every rank: where the ranks span several hosts, each host's first rank in turn measures
    its link to the driver and reports it (the others wait at a barrier); whether they did.

    >>> probe_links()  # doctest: +SKIP
    True
    """
    hosts = sr.cross_size()
    if hosts < 2:
        return False
    for turn in range(hosts):
        if sr.cross_rank() == turn and sr.local_rank() == 0:
            with recorder.span("link probe: to the driver"):
                rate = measure_link(probe_bytes)
            if rate is not None:
                report(to_payload(LinkMeasured(socket.gethostname(), rate, hosts)))
        sr.barrier()
    return True
