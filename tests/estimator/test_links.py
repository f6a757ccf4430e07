"""The driver's link report: each host's measured link to the driver, and a host at a tenth of the
others' rate named as the straggler once every host's rate arrived (the probe itself across
simulated hosts: tests/integration/test_hosts.py; measure_link: tests/runner/test_runner.py)."""
from sparkring.estimator import links
from sparkring.trainer.events import LinkMeasured, from_payload, to_payload


def measured(report, host, rate, hosts):
    report(0, from_payload(to_payload(LinkMeasured(host, rate, hosts))))  # through the channel's JSON


def test_a_host_at_a_tenth_of_the_others_rate_is_named_the_straggler_once_every_host_is_measured():
    said = []
    report = links.LinkReport(said.append)
    measured(report, "h0", 125e6, hosts=3)
    measured(report, "h2", 12.5e6, hosts=3)
    assert said == []  # not before the last host's rate
    measured(report, "h1", 125e6, hosts=3)
    assert len(said) == 1 and said[0].startswith("straggler: host h2's link moves 12.5 MB/s, 0.10x the other hosts' "
                                                 "125.0 MB/s"), said


def test_links_alike_name_no_straggler():
    said = []
    report = links.LinkReport(said.append)
    measured(report, "h0", 125e6, hosts=2)
    measured(report, "h1", 100e6, hosts=2)  # within half of each other
    assert said == [] and report.rates == {"h0": 125e6, "h1": 100e6}
