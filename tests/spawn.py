"""Ranks as plain processes on the runner's environment contract, for tests that need
more ranks than the Spark sessions have slots."""
import importlib
import multiprocessing
import os
import pickle
import socket


def _rank_entry(rank, size, port, module, fn_name, kwargs, queue):
    os.environ.update(SPARKRING_RANK=str(rank), SPARKRING_SIZE=str(size), SPARKRING_MASTER_ADDR="127.0.0.1",
                      SPARKRING_MASTER_PORT=str(port), SPARKRING_BACKEND="gloo", GLOO_SOCKET_IFNAME="lo",
                      OMP_NUM_THREADS="1")
    import sparkring.collective as sr

    fn = getattr(importlib.import_module(module), fn_name)
    sr.init()
    try:
        # plain pickle bytes: tensors through a multiprocessing queue would travel as shared
        # memory that vanishes when this process exits before the parent reads it
        queue.put((rank, pickle.dumps(fn(**kwargs))))
    finally:
        sr.shutdown()


def spawn_ranks(module, fn_name, size, **kwargs):
    """Run ``module.fn_name(**kwargs)`` on ``size`` ranks; results by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, args=(r, size, port, module, fn_name, kwargs, queue))
             for r in range(size)]
    for p in procs:
        p.start()
    results = {rank: pickle.loads(data) for rank, data in (queue.get(timeout=120) for _ in range(size))}
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return [results[r] for r in range(size)]
