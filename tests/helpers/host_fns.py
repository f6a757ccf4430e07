"""Rank functions the simulated-hosts tests and benchmarks run (tests/integration/test_hosts.py,
benchmarks/bench_hosts.py)."""
import os
import platform
import time

import torch

import sparkring.collective as sr


def where_and_sum(floats):
    """Where this rank is, and an allreduce whose exact sum every rank can check."""
    sr.init()
    mine = torch.arange(floats, dtype=torch.float64) * (sr.rank() + 1)
    total = sr.allreduce(mine, op=sr.Sum)
    return {"rank": sr.rank(), "host": platform.node(), "local_rank": sr.local_rank(), "local_size": sr.local_size(),
            "cross_rank": sr.cross_rank(), "cross_size": sr.cross_size(), "total": total.tolist()[:8],
            "checksum": float(total.sum()), "shm_segments": len(os.listdir("/dev/shm"))}


def _link_bytes():
    """Bytes this host's eth0 carried so far, both ways (a simulated host's only link)."""
    total = 0
    for direction in ("rx_bytes", "tx_bytes"):
        with open(f"/sys/class/net/eth0/statistics/{direction}") as f:
            total += int(f.read())
    return total


def allreduce_seconds(sizes_mb, repeats, compression="none"):
    """Per size: seconds of the fastest of ``repeats`` float32 allreduces (after a warm-up), and
    the bytes this rank's host link carried per allreduce (both ways, all of the host's ranks);
    ``compression`` ("none", "fp16", "bf16") is how the tensors travel."""
    sr.init()
    how = getattr(sr.Compression, compression)
    out = {}
    for mb in sizes_mb:
        tensor = torch.ones(int(mb * 2**20) // 4)
        sr.allreduce(tensor, op=sr.Sum, compression=how)
        best = float("inf")
        sr.barrier()
        before = _link_bytes()
        for _ in range(repeats):
            sr.barrier()
            started = time.perf_counter()
            sr.allreduce(tensor, op=sr.Sum, compression=how)
            best = min(best, time.perf_counter() - started)
        sr.barrier()
        out[mb] = {"seconds": best, "link_bytes": (_link_bytes() - before) / repeats}
    return out


def allreduce_until_stopped(flag_path):
    """Allreduce in a loop (saying so once) until ``flag_path`` exists or a peer is lost."""
    sr.init()
    tensor = torch.ones(256 * 1024)
    said = False
    while not os.path.exists(flag_path):
        sr.allreduce(tensor, op=sr.Sum)
        if not said:
            print("allreducing", flush=True)
            said = True
        time.sleep(0.05)
    return "stopped"


def deep_mlp():
    """A classifier of ten similar 512-wide blocks (about 2.6M parameters, 10.5 MB in float32): its
    gradients come block after block during backward, as a transformer's do, so their exchange can
    hide behind the backward of the blocks below."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 512), torch.nn.ReLU()]
    for _ in range(10):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(512, 3))


def wide_mlp():
    """A classifier of about 2.1M parameters (8.4 MB in float32): enough weights that sharding
    them across hosts shows on the links."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 3))
