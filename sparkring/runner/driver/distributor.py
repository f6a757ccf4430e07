"""``sparkring.TorchDistributor``: the constructor and ``run()`` of Spark's
``pyspark.ml.torch.distributor.TorchDistributor``, launched by sparkring (one barrier stage, or
local processes on the driver host with ``local_mode=True``), so switching is an import."""
from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable, List, Optional, Union

import cloudpickle

from ...collective import environment
from ...collective.ports import free_ports
from ...errors import ConfigurationError, RankFailedError, RankTimeoutError
from ..gpus import VISIBLE
from ..pickling import to_bytes
from ..task.rank import RankProcess, first_to_fail, supervise
from ..task.workdir import WorkDir
from .launch import active_spark, run
from .plan import local_backend
from .script import ScriptMain


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
        if local_mode:
            local_backend(num_processes, use_gpu)  # refuses, before any process starts, what it cannot run
        self.num_tasks = self._num_tasks()
        self.input_params = {"num_processes": num_processes, "local_mode": local_mode, "use_gpu": use_gpu,
                             "num_tasks": self.num_tasks}

    def _num_tasks(self) -> int:
        """Spark's rule: on a cluster with GPUs, one task holds spark.task.resource.gpu.amount of
        them, so num_processes / that many tasks (refused, naming the conf, where it is unset)."""
        if not self.use_gpu or self.local_mode:
            return self.num_processes
        key = "spark.task.resource.gpu.amount"
        amount = float((self.spark or active_spark()).conf.get(key, "0") or 0)
        if amount < 1:
            raise RuntimeError(f"'{key}' was unset, so gpu usage is unavailable: set it (GPUs per task) on the "
                               "session, or pass use_gpu=False")
        if not float(amount).is_integer() or self.num_processes % int(amount):
            raise ConfigurationError(
                f"num_processes={self.num_processes} with {key}={amount:g}: each task runs one process per GPU it "
                f"holds, so num_processes must be a multiple of a whole {key}")
        return self.num_processes // int(amount)

    def run(self, train_object: Union[Callable[..., Any], str], *args: Any, **kwargs: Any) -> Optional[Any]:
        """Run ``train_object`` on every process; rank 0's return value for a function, None
        for a script.

        >>> distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)  # doctest: +SKIP
        >>> distributor.run("train.py", "--lr", "0.1")  # doctest: +SKIP
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
            # Spark 4.2's layout: a task holding several GPUs runs a process on each
            results = run(fn, args=args, kwargs=kwargs, num_proc=self.num_processes, use_gpu=self.use_gpu,
                          ranks_per_task=self.num_processes // self.num_tasks,
                          start_timeout=self.start_timeout, timeout=self.timeout, verbose=self.verbose,
                          spark=self.spark or active_spark())
        return None if script else results[0]


def run_local(fn: Callable[..., Any], args, kwargs, num_proc: int, use_gpu: bool, timeout: Optional[float],
              verbose: int = 1) -> List[Any]:
    """Run ``fn`` on ``num_proc`` fresh processes of this host, no Spark tasks (what
    TorchDistributor's local_mode does), through the barrier task's own rank launcher; results
    ordered by rank.

    >>> run_local(fn, (), {}, 2, use_gpu=False, timeout=None)  # doctest: +SKIP
    """
    host = os.environ.get("SPARK_LOCAL_IP") or "127.0.0.1"
    store_port, torch_port = free_ports(host, 2)
    payload = to_bytes((fn, tuple(args), kwargs or {}))
    backend = local_backend(num_proc, use_gpu)
    printing = threading.Lock()
    ranks: List[RankProcess] = []
    try:
        for rank in range(num_proc):
            workdir = WorkDir.create(rank)
            place = environment.RankEnv(
                rank=rank, size=num_proc, local_rank=rank, local_size=num_proc, master_addr=host,
                master_port=store_port, torch_port=torch_port, run_id="local", backend=backend,
                parent_pid=os.getpid(), event_file=workdir.events, gpu=rank if use_gpu else None)
            env = {k: v for k, v in os.environ.items() if k != environment.DRIVER}
            env.update(place.to_env())
            env.update({environment.WORKER_START: "spawn",  # the driver holds a JVM, which must not be forked
                        VISIBLE: ",".join(str(i) for i in range(num_proc)) if use_gpu else "",
                        "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
            ranks.append(RankProcess(rank, workdir, payload, env, _printer(rank, verbose, printing)))
        late = supervise(ranks, timeout)
        if late:
            stacks = "\n\n".join(f"rank {r.rank}:\n{r.stacks}" for r in late)
            raise RankTimeoutError(f"ranks {[r.rank for r in late]} exceeded timeout={timeout:g}s and were killed; "
                                   f"where their threads were:\n{stacks}", [r.rank for r in late])
        if any(r.failed() for r in ranks):
            first = first_to_fail(ranks)
            raised, message = first.raised()
            raise RankFailedError(first.rank, first.failure(), first.returncode, exception_type=raised, message=message)
        return [cloudpickle.loads(r.result()) for r in ranks]
    finally:
        for r in ranks:
            r.close()


def _printer(rank: int, verbose: int, lock: threading.Lock) -> Callable[[str, str], None]:
    """What the user asked to see of a local rank's output: rank 0's (verbose=1), every rank's
    prefixed with its number (verbose=2), nothing (verbose=0)."""

    def show(stream: str, line: str) -> None:
        if verbose >= 2 or (verbose == 1 and rank == 0):
            with lock:
                print(f"[{rank}] {line}" if verbose >= 2 else line,
                      file=sys.stdout if stream == "stdout" else sys.stderr, flush=True)

    return show
