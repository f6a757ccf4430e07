"""The driver's side of the link probe (trainer/link_probe.py): each host's measured link to the
driver, and a host whose link is far slower than the others' named as the fit's straggler, in a
line before the first epoch's and in the log.

>>> straggler({"h0": 118e6, "h1": 11.9e6, "h2": 117e6})
('h1', 11900000.0, 117500000.0)
>>> straggler({"h0": 118e6, "h1": 100e6}) is None
True
"""
from __future__ import annotations

import logging
import statistics
from typing import Callable, Dict, Optional, Tuple

from ..trainer.events import LinkMeasured, TrainingEvent

log = logging.getLogger(__name__)

SLOW = 0.5  # a link at less than half the others' median rate holds every ring step back


def straggler(rates: Dict[str, float]) -> Optional[Tuple[str, float, float]]:
    """The host whose rate is below ``SLOW`` times the median of the others', with its rate and
    theirs; None where every link is alike (or fewer than two were measured)."""
    if len(rates) < 2:
        return None
    slowest = min(rates, key=lambda host: rates[host])
    others = statistics.median(rate for host, rate in rates.items() if host != slowest)
    return (slowest, rates[slowest], others) if rates[slowest] < SLOW * others else None


class LinkReport:
    """A fit's listener: each host's measured link; once every host's arrived, names the straggler
    (``say`` shows the line; the log has it as a warning) or logs the rates.

    >>> LinkReport(say=print)(0, LinkMeasured("h0", 118e6, hosts=2))  # doctest: +SKIP
    """

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.rates: Dict[str, float] = {}

    def __call__(self, rank: int, event: TrainingEvent) -> None:
        """Keep a host's rate; with the last host's, say what they show."""
        if not isinstance(event, LinkMeasured):
            return
        self.rates[event.host] = event.bytes_per_second
        if len(self.rates) == event.hosts:
            self._report()

    def _report(self) -> None:
        shown = ", ".join(f"{host} {rate / 1e6:.1f} MB/s" for host, rate in sorted(self.rates.items()))
        found = straggler(self.rates)
        if found is None:
            log.info("links to the driver: %s", shown)
            return
        host, rate, others = found
        line = (f"straggler: host {host}'s link moves {rate / 1e6:.1f} MB/s, {rate / others:.2f}x the other hosts' "
                f"{others / 1e6:.1f} MB/s (links to the driver: {shown}); every ring step waits for it")
        log.warning(line)
        self.say(line)
