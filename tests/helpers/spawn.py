"""Ranks as plain processes on the runner's environment contract, for tests that need
more ranks than the Spark sessions have slots (or no Spark at all). A watchdog turns a
hang into a failure and no rank outlives the call.

Ranks fork from a server that imported torch and sparkring.collective once (multiprocessing's
forkserver): a rank starts in a fraction of a second instead of importing torch for ~2 s (a
2-rank call 1.3 s instead of 3.9 s; these tests ~200 s less in all). Nothing there has run a collective or an
OpenMP region; each rank gets the caller's environment, working directory, stdout and stderr as spawn gives them."""
import importlib
import multiprocessing
import os
import pickle
import queue as queue_module
import socket
import traceback
from multiprocessing import reduction


class RankError(AssertionError):
    """A spawned rank raised: carries the rank and its traceback."""

    def __init__(self, rank, tb):
        self.rank = rank
        self.tb = tb
        super().__init__(f"rank {rank} raised:\n{tb}")


# what the fork server imports once; a rank imports its test module itself
PRELOAD = ["torch", "sparkring.collective"]


class _CallersFd:
    """One of the caller's file descriptors, sent along with the rank (the fork server's
    descriptor passing): where the caller's stdout and stderr point now, capfd's file in a test."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup):
    return dup.detach()


def _rank_entry(rank, size, port, module, fn_name, kwargs, queue, rank_env, environ, stdio):
    for target, fd in zip((1, 2), stdio):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()  # the caller's environment now, not the fork server's from when it started
    os.environ.update(environ)
    os.environ.update(SPARKRING_RANK=str(rank), SPARKRING_SIZE=str(size), SPARKRING_MASTER_ADDR="127.0.0.1",
                      SPARKRING_MASTER_PORT=str(port), SPARKRING_BACKEND="gloo", GLOO_SOCKET_IFNAME="lo",
                      OMP_NUM_THREADS="1")
    os.environ.update((rank_env or {}).get(rank, {}))
    import torch

    import sparkring.collective as sr

    # OpenMP read OMP_NUM_THREADS when the server loaded torch: what this rank's environment says
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    fn = getattr(importlib.import_module(module), fn_name)
    sr.init()
    try:
        # plain pickle bytes: tensors through a multiprocessing queue would travel as shared
        # memory that vanishes when this process exits before the parent reads it
        queue.put((rank, "ok", pickle.dumps(fn(**kwargs))))
    except BaseException:  # noqa: BLE001 - the test wants to see it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        sr.shutdown()


def _start(module, fn_name, size, kwargs, rank_env=None):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    environ = dict(os.environ)
    stdio = (_CallersFd(1), _CallersFd(2))
    procs = [ctx.Process(target=_rank_entry,
                         args=(r, size, port, module, fn_name, kwargs, queue, rank_env, environ, stdio))
             for r in range(size)]
    for p in procs:
        p.start()
    return procs, queue


def _collect(procs, queue, size, timeout):
    """(rank, kind, data) of every rank; no rank outlives the call."""
    got = {}
    try:
        for _ in range(size):
            try:
                rank, kind, data = queue.get(timeout=timeout)
            except queue_module.Empty:
                missing = sorted(set(range(size)) - set(got))
                raise AssertionError(f"ranks {missing} did not answer within {timeout}s (hang?)") from None
            got[rank] = (kind, data)
    finally:
        failed = any(kind == "error" for kind, _ in got.values())
        for p in procs:
            p.join(2 if failed else 10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return got


def spawn_ranks(module, fn_name, size, timeout=120, rank_env=None, **kwargs):
    """Run ``module.fn_name(**kwargs)`` on ``size`` ranks; results by rank. A rank that
    raises raises RankError here; ranks that do not answer within ``timeout`` fail the call.
    ``rank_env``: rank -> environment variables set before that rank joins the ring."""
    got = _collect(*_start(module, fn_name, size, kwargs, rank_env), size, timeout)
    errors = {rank: data for rank, (kind, data) in got.items() if kind == "error"}
    if errors:
        first = min(errors)
        raise RankError(first, errors[first])
    return [pickle.loads(got[r][1]) for r in range(size)]


def spawn_errors(module, fn_name, size, timeout=30, rank_env=None, **kwargs):
    """Like spawn_ranks, but every rank is expected to raise: (status, traceback or result) by rank."""
    got = _collect(*_start(module, fn_name, size, kwargs, rank_env), size, timeout)
    return [(kind, data if kind == "error" else pickle.loads(data)) for kind, data in (got[r] for r in range(size))]
