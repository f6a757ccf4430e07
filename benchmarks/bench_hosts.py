"""Across hosts: simulated hosts on this machine (tests/helpers/sim_hosts.py: network namespaces,
links shaped by tc's token bucket, a standalone worker on each, the driver on a head of its own).
Allreduce bus bandwidth against the link rate, the bytes a host's link carries per allreduce with
the hierarchical path (shared memory inside a host, the hosts' leaders across) against the flat
ring of ranks, fsdp against hsdp in a fit, and the seconds from a host cut off the network to the
caller's error and to an elastic fit's next step without it. Needs root."""
from __future__ import annotations

import os
import time

import host_fns
from common import Row
from sim_hosts import Link, SimulatedHosts, why_not

MB = 2**20
BATCH = 1024  # rows a rank's step: backward long enough to hide the gradients' allreduce at 1 Gbit/s


def _bus_bandwidth(result, ranks):
    """Allreduce bus bandwidth per size (bytes/s): 2 (n-1)/n of the tensor through each rank's link."""
    return {float(mb): 2 * (ranks - 1) / ranks * float(mb) * MB / r["seconds"] for mb, r in result.items()}


def _ring_section(rows, tmp, count, rate, sizes, reps):
    hosts = SimulatedHosts(count, Link(rate)).start()
    try:
        cluster = hosts.spark_cluster(os.path.join(tmp, f"hosts-{count}-{rate}"), dict(os.environ), cores=1)
        seen = cluster.drive("bandwidth", {"sizes_mb": sizes, "repeats": reps, "ranks": count, "cores_per_host": 1,
                                           "hosts": count})
    finally:
        hosts.stop()
    link = Link(rate).bytes_per_second
    for mb, bus in _bus_bandwidth(seen, count).items():
        goal = ">= 0.9x" if mb == 64 else "(reference)"
        rows.append(Row("across hosts", f"allreduce bus bandwidth, {count} hosts x 1 rank, {rate}/s links, "
                        f"{mb:g} MB float32 (gloo ring across hosts)", f"{bus / 1e6:,.0f} MB/s",
                        f"link {link / 1e6:,.0f} MB/s", bus / link, goal, goal_value=0.9 if mb == 64 else None))


def _hierarchy_section(rows, tmp, reps):
    hosts = SimulatedHosts(2, Link("1gbit")).start()
    try:
        cluster = hosts.spark_cluster(os.path.join(tmp, "hosts-2x2"), dict(os.environ), cores=2)
        args = {"sizes_mb": [64], "repeats": reps, "ranks": 4, "cores_per_host": 2, "hosts": 2}
        ours = cluster.drive("bandwidth", {**args, "shared_memory": True})["64"]
        flat = cluster.drive("bandwidth", {**args, "shared_memory": False})["64"]
    finally:
        hosts.stop()
    # a ring of the 2 hosts moves the tensor once each way over each host's link: 2 x 64 MB
    ring_of_hosts = 2 * 64 * MB
    rows.append(Row("across hosts", "bytes a host's link carries per 64 MB allreduce, 2 hosts x 2 ranks, "
                    "hierarchical (shared memory in a host, leaders across) vs what a ring of hosts sends "
                    "(2 x 64 MB)", f"{ours['link_bytes'] / MB:,.0f} MB", f"ring of hosts {ring_of_hosts / MB:,.0f} MB",
                    ours["link_bytes"] / ring_of_hosts, "<= 1.05x", higher_is_better=False, goal_value=1.05))
    rows.append(Row("across hosts", "the same, flat gloo ring of the 4 ranks (shared_memory=False) vs hierarchical",
                    f"{flat['link_bytes'] / MB:,.0f} MB", f"hierarchical {ours['link_bytes'] / MB:,.0f} MB",
                    flat["link_bytes"] / ours["link_bytes"], "(reference)", higher_is_better=False))
    rows.append(Row("across hosts", "64 MB allreduce time, 2 hosts x 2 ranks at 1gbit/s: hierarchical vs flat",
                    f"{ours['seconds']:.2f} s", f"flat {flat['seconds']:.2f} s", flat["seconds"] / ours["seconds"],
                    "(reference)"))


def _compression_section(rows, tmp, reps):
    hosts = SimulatedHosts(2, Link("1gbit")).start()
    try:
        cluster = hosts.spark_cluster(os.path.join(tmp, "hosts-bf16"), dict(os.environ), cores=1)
        args = {"sizes_mb": [64], "repeats": reps, "ranks": 2, "cores_per_host": 1, "hosts": 2}
        plain = cluster.drive("bandwidth", {**args, "compression": "none"})["64"]
        bf16 = cluster.drive("bandwidth", {**args, "compression": "bf16"})["64"]
    finally:
        hosts.stop()
    rows.append(Row("across hosts", "64 MB float32 allreduce, 2 hosts at 1gbit/s: compression=bf16 (what "
                    "gradientCompression='bf16' sends) vs none, time", f"{bf16['seconds']:.2f} s",
                    f"none {plain['seconds']:.2f} s", plain["seconds"] / bf16["seconds"], "(reference)"))
    rows.append(Row("across hosts", "the same, bytes on a host's link (the time on the wire at the link's rate)",
                    f"{bf16['link_bytes'] / MB:,.0f} MB", f"none {plain['link_bytes'] / MB:,.0f} MB",
                    plain["link_bytes"] / bf16["link_bytes"], ">= 1.9x (halved)", goal_value=1.9))


def _sharded_section(rows, tmp):
    """fsdp (every rank's shards, across the hosts) against hsdp (shards within a host, replicas
    across): 2 hosts x 2 ranks at 1 Gbit/s, the bytes on a host's link and the training seconds."""
    hosts = SimulatedHosts(2, Link("1gbit")).start()
    seen = {}
    try:
        cluster = hosts.spark_cluster(os.path.join(tmp, "hosts-sharded"), dict(os.environ), cores=2)
        for strategy in ("fsdp", "hsdp", "fsdp", "hsdp"):  # the first of each warms the workers up
            before = hosts.bytes_through(0)
            fit = cluster.drive("sharded", {"strategy": strategy, "ranks": 4, "rows": 2048, "cores_per_host": 2,
                                            "hosts": 2, "store": os.path.join(tmp, f"sharded-{strategy}")})
            seen[strategy] = {**fit, "link_bytes": hosts.bytes_through(0) - before}
    finally:
        hosts.stop()
    fsdp, hsdp = seen["fsdp"], seen["hsdp"]
    rows.append(Row("across hosts", f"a fit of a 2.1M-parameter MLP, 2 hosts x 2 ranks at 1gbit/s, {fsdp['steps']} "
                    "steps: bytes on a host's link, hsdp (shards in a host, replicas across) vs fsdp (shards across)",
                    f"{hsdp['link_bytes'] / MB:,.0f} MB", f"fsdp {fsdp['link_bytes'] / MB:,.0f} MB",
                    fsdp["link_bytes"] / hsdp["link_bytes"], "(reference)"))
    rows.append(Row("across hosts", "the same fits' training seconds (first step and epochs), hsdp vs fsdp",
                    f"{hsdp['seconds']:.1f} s", f"fsdp {fsdp['seconds']:.1f} s", fsdp["seconds"] / hsdp["seconds"],
                    "(reference)"))


def _overlap_section(rows, tmp, reps, per_host, model="wide"):
    """A ddp fit's step across 2 hosts x ``per_host`` ranks at 1 Gbit/s against max(compute,
    communication): compute is the same fit's step with its ranks on one host (its allreduce at
    memory speed, so an upper bound), communication the allreduce of ``model``'s gradients
    (host_fns.wide_mlp's or deep_mlp's) across the hosts."""
    hosts = SimulatedHosts(2, Link("1gbit")).start()
    ranks, steps = 2 * per_host, {}
    try:
        cluster = hosts.spark_cluster(os.path.join(tmp, f"hosts-overlap-{per_host}"), dict(os.environ),
                                      cores=per_host)
        make = {"wide": host_fns.wide_mlp, "deep": host_fns.deep_mlp}[model]
        parameters = sum(p.numel() for p in make().parameters())
        grads_mb = parameters * 4 / MB
        comm = cluster.drive("bandwidth", {"sizes_mb": [grads_mb], "repeats": reps, "ranks": ranks,
                                           "cores_per_host": per_host, "hosts": 2})
        one_host = f"local[{ranks}]"
        for where, master in (("across", None), (one_host, one_host)) * 2:  # the second of each: workers warm
            fit = cluster.drive("sharded", {"strategy": "ddp", "ranks": ranks, "rows": 32 * BATCH, "batch": BATCH,
                                            "cores_per_host": per_host, "hosts": 2, "model": model,
                                            "store": os.path.join(tmp, "overlap")}, master=master)
            steps[where] = fit["epoch_seconds"] / fit["steps"]
    finally:
        hosts.stop()
    communication = next(iter(comm.values()))["seconds"]
    bound = max(steps[one_host], communication)
    shape = {"wide": "3 layers 1024 wide", "deep": "11 layers 512 wide"}[model]
    rows.append(Row("across hosts", f"a ddp fit's step, {parameters / 1e6:.1f}M-parameter MLP ({shape}), batches "
                    f"of {BATCH} a rank, 2 hosts x "
                    f"{per_host} rank(s) at 1gbit/s, "
                    f"vs max(compute {steps[one_host] * 1e3:.0f} ms: the same fit on one host, communication "
                    f"{communication * 1e3:.0f} ms: its {grads_mb:.1f} MB gradients' allreduce across the hosts)",
                    f"{steps['across'] * 1e3:.0f} ms", f"bound {bound * 1e3:.0f} ms", steps["across"] / bound,
                    "<= 1.15x", higher_is_better=False, goal_value=1.15))


def _cut_section(rows, tmp):
    hosts = SimulatedHosts(2, Link("1gbit")).start()
    cut_at = []

    def cut_when_running(line):
        if "allreducing" in line and not cut_at:
            time.sleep(2.0)
            hosts.cut(1)
            cut_at.append(time.time())

    try:
        cluster = hosts.spark_cluster(os.path.join(tmp, "hosts-cut"), dict(os.environ), cores=1)
        seen = cluster.drive("cut", {"ranks": 2, "flag": os.path.join(tmp, "never"), "heartbeat_timeout": 30.0,
                                     "cores_per_host": 1}, on_line=cut_when_running)
    finally:
        hosts.stop()
    assert seen["error"] == "HostLostError", seen
    waited = seen["at"] - cut_at[0]
    rows.append(Row("across hosts", "seconds from a host's link cut mid-allreduce to HostLostError at the caller of "
                    "run() (heartbeatTimeout 30 s default, no timeout set)", f"{waited:.1f} s", "goal 45 s",
                    waited / 45.0, "<= 1.0x", higher_is_better=False, goal_value=1.0))


def _elastic_section(rows, tmp):
    """An elastic fit of 4 ranks on 2 hosts whose host 1 is cut at a checkpoint (heartbeatTimeout
    30 s, the default): the seconds until the driver goes on with the 2 ranks left, and until they
    resume training from the checkpoint."""
    hosts = SimulatedHosts(2, Link("1gbit")).start()
    try:
        cluster = hosts.spark_cluster(os.path.join(tmp, "hosts-elastic"), dict(os.environ), cores=2)
        loss = cluster.elastic_fit_losing_host(1, "cut", os.path.join(tmp, "elastic-cut"), 30.0)
    finally:
        hosts.stop()
    assert loss.lost_at and loss.going_on_at and loss.resumed_at, loss
    for what, at in (("the driver going on with the 2 ranks left", loss.going_on_at),
                     ("those ranks resuming from the checkpoint (their next step)", loss.resumed_at)):
        waited = at - loss.lost_at
        rows.append(Row("across hosts", f"seconds from a host's link cut in an elastic fit (numProc=4, minProc=2, "
                        f"heartbeatTimeout 30 s) to {what}", f"{waited:.1f} s", "goal 45 s", waited / 45.0,
                        "<= 1.0x", higher_is_better=False, goal_value=1.0))


def bench_hosts(spark, rows, reps, tmp):
    """The "across hosts" rows (skipped, saying why, where hosts cannot be simulated)."""
    reason = why_not()
    if reason is not None:
        print(f"across hosts: skipped ({reason})")
        return
    sizes = [1, 16, 64, 256]
    _ring_section(rows, tmp, 2, "1gbit", sizes, reps)
    _ring_section(rows, tmp, 4, "1gbit", [64], reps)
    _ring_section(rows, tmp, 2, "10gbit", [64, 256], reps)
    _hierarchy_section(rows, tmp, reps)
    _compression_section(rows, tmp, reps)
    _sharded_section(rows, tmp)
    for model in ("wide", "deep"):
        _overlap_section(rows, tmp, reps, 1, model)
        _overlap_section(rows, tmp, reps, 2, model)
    _cut_section(rows, tmp)
    _elastic_section(rows, tmp)
