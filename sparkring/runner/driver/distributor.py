"""``sparkring.TorchDistributor``: the constructor and ``run()`` of Spark's
``pyspark.ml.torch.distributor.TorchDistributor``, launched by sparkring (one barrier stage, or
local processes on the driver host with ``local_mode=True``), so switching is an import."""
from __future__ import annotations

import collections
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Union

import cloudpickle

from ...collective import _env
from ...errors import ConfigurationError, RankFailedError, RankTimeoutError
from ..pickling import to_bytes
from ..task.process import dump_stacks, free_ports, kill_tree
from .launch import ScriptMain, _active_spark, run


class TorchDistributor:
    """Runs a torch.distributed training function or script on ``num_processes`` processes.

    Same constructor and ``run(train_object, *args, **kwargs)`` as Spark's TorchDistributor:
    ``train_object`` is a function (its rank-0 return value comes back) or the path of a
    script (run with ``args`` as its command line; returns None). Inside, the torchrun
    environment is set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT...), so
    ``dist.init_process_group("gloo")`` and DDP work unchanged.

    >>> from sparkring import TorchDistributor
    >>> TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 1e-3)  # doctest: +SKIP
    0.42
    """

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True,
                 timeout: Optional[float] = None, start_timeout: float = 120, verbose: int = 1, spark=None):
        if not isinstance(num_processes, int) or num_processes < 1:
            raise ConfigurationError(f"num_processes={num_processes!r}: it must be a positive integer")
        if timeout is not None and timeout <= 0:
            raise ConfigurationError(f"timeout={timeout}: it must be positive (seconds) or None")
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.verbose = verbose
        self.spark = spark
        if local_mode and use_gpu:
            import torch

            if torch.cuda.device_count() < num_processes:
                raise ConfigurationError(
                    f"use_gpu=True with local_mode=True needs {num_processes} GPU(s) on this host, which has "
                    f"{torch.cuda.device_count()}: pass use_gpu=False, or fewer num_processes")

    def run(self, train_object: Union[Callable[..., Any], str], *args: Any, **kwargs: Any) -> Optional[Any]:
        """Run ``train_object`` on every process; rank 0's return value for a function, None
        for a script.

        >>> TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run("train.py", "--lr", "0.1")  # doctest: +SKIP
        """
        script = isinstance(train_object, (str, os.PathLike))
        if script:
            fn: Callable[..., Any] = ScriptMain(str(train_object), [str(a) for a in args])
            args, kwargs = (), {}
        elif callable(train_object):
            fn = train_object
        else:
            raise ConfigurationError(f"train_object must be a function or a script path, got "
                                     f"{type(train_object).__name__}")
        if self.local_mode:
            results = run_local(fn, args, kwargs, self.num_processes, self.use_gpu, self.timeout, self.verbose)
        else:
            results = run(fn, args=args, kwargs=kwargs, num_proc=self.num_processes, use_gpu=self.use_gpu,
                          start_timeout=self.start_timeout, timeout=self.timeout, verbose=self.verbose,
                          spark=self.spark or _active_spark())
        return None if script else results[0]


def run_local(fn: Callable[..., Any], args, kwargs, num_proc: int, use_gpu: bool, timeout: Optional[float],
              verbose: int = 1) -> List[Any]:
    """Run ``fn`` on ``num_proc`` fresh processes of this host, no Spark tasks (what
    TorchDistributor's local_mode does); results ordered by rank.

    >>> run_local(fn, (), {}, 2, use_gpu=False, timeout=None)  # doctest: +SKIP
    """
    host = os.environ.get("SPARK_LOCAL_IP") or "127.0.0.1"
    store_port, torch_port = free_ports(host, 2)
    payload = to_bytes((fn, tuple(args), kwargs or {}))
    gpus = ",".join(str(i) for i in range(num_proc)) if use_gpu else ""
    procs, workdirs = [], []
    lock = threading.Lock()
    tails: Dict[int, collections.deque] = {}

    def pump(stream, rank: int, target):
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            tails[rank].append(line)
            if verbose >= 2 or (verbose == 1 and rank == 0):
                with lock:
                    print(f"[{rank}] {line}" if verbose >= 2 else line, file=target, flush=True)
        stream.close()

    from ..task.process import start_worker

    try:
        for rank in range(num_proc):
            workdir = tempfile.mkdtemp(prefix=f"sparkring-local{rank}-")
            workdirs.append(workdir)
            with open(os.path.join(workdir, "payload.pkl"), "wb") as f:
                f.write(payload)
            env = dict(os.environ)
            env.update({
                _env.RANK: str(rank), _env.SIZE: str(num_proc), _env.LOCAL_RANK: str(rank),
                _env.LOCAL_SIZE: str(num_proc), _env.CROSS_RANK: "0", _env.CROSS_SIZE: "1",
                _env.MASTER_ADDR: host, _env.MASTER_PORT: str(store_port), _env.BACKEND: "auto",
                _env.PARENT_PID: str(os.getpid()), _env.WORKER_START: "spawn",
                _env.EVENT_FILE: os.path.join(workdir, "events.jsonl"),
                "CUDA_VISIBLE_DEVICES": gpus, "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            })
            env.pop(_env.DRIVER, None)
            env.update(_env.torchrun_env(rank=rank, size=num_proc, local_rank=rank, local_size=num_proc,
                                         node_rank=0, nodes=1, master_addr=host, master_port=torch_port,
                                         run_id="local"))
            tails[rank] = collections.deque(maxlen=40)
            proc = start_worker(workdir, env)  # spawn: the driver holds a JVM, which must not be forked
            procs.append(proc)
            for stream, target in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                threading.Thread(target=pump, args=(stream, rank, target), daemon=True).start()
        started = time.monotonic()
        while any(p.poll() is None for p in procs):
            failed = [rank for rank, proc in enumerate(procs) if proc.poll() not in (None, 0)]
            if failed:
                rank = _first_to_fail(failed, workdirs)
                raise _local_failure(rank, procs[rank].returncode, workdirs[rank], tails[rank])
            if timeout is not None and time.monotonic() - started > timeout:
                late = [r for r, p in enumerate(procs) if p.poll() is None]
                stacks = "\n\n".join(f"rank {r}:\n{dump_stacks(procs[r], workdirs[r])}" for r in late)
                raise RankTimeoutError(f"ranks {late} exceeded timeout={timeout:g}s and were killed; where "
                                       f"their threads were:\n{stacks}", late)
            time.sleep(0.05)
        failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
        if failed:
            rank = _first_to_fail(failed, workdirs)
            raise _local_failure(rank, procs[rank].returncode, workdirs[rank], tails[rank])
        results = []
        for workdir in workdirs:
            with open(os.path.join(workdir, "result.pkl"), "rb") as f:
                results.append(cloudpickle.load(f))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)


def _first_to_fail(ranks: List[int], workdirs: List[str]) -> int:
    """The rank that failed first (its error file is the oldest): the others usually fail
    because it went away."""
    def written(rank: int) -> float:
        try:
            return os.stat(os.path.join(workdirs[rank], "error.txt")).st_mtime_ns
        except OSError:
            return float("inf")

    return min(ranks, key=written)


def _local_failure(rank: int, code: int, workdir: str, tail) -> RankFailedError:
    path = os.path.join(workdir, "error.txt")
    if os.path.exists(path):
        with open(path) as f:
            return RankFailedError(rank, f.read(), code)
    return RankFailedError(rank, f"process exited with code {code}; last output:\n" + "\n".join(tail), code)
