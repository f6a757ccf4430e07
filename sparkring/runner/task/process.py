"""A rank's worker process as its task sees it: start it (forked with torch preloaded, or
under mpiexec), dump its Python stacks, kill it with everything it started (its process tree)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Dict, Optional, Tuple

from ...collective import environment
from ...collective.hosting import transport
from ...process_start import log_if_spawning, start_method
from .._probe import find_mpiexec
from .workdir import WorkDir

log = logging.getLogger(__name__)

WORKER_MODULE = "sparkring.runner.task.worker"


def kill_tree(proc) -> None:
    """Kill the worker and everything it started (it leads its own process group)."""
    try:
        import psutil

        children = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001
        children = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for child in children:
        try:
            child.kill()
        except Exception:  # noqa: BLE001
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def dump_stacks(proc, workdir: str) -> str:
    """Ask the worker for its Python stacks (faulthandler on SIGUSR1) before killing it."""
    path = WorkDir(workdir).stacks
    try:
        with open(WorkDir(workdir).pid) as f:
            pid = int(f.read())
    except (OSError, ValueError):
        pid = proc.pid
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return "(process already gone)"
    deadline = time.monotonic() + 2
    size = -1
    while time.monotonic() < deadline:
        time.sleep(0.2)
        current = os.path.getsize(path) if os.path.exists(path) else 0
        if current and current == size:
            break
        size = current
    try:
        with open(path) as f:
            return f.read().strip() or "(no stack dump)"
    except OSError:
        return "(no stack dump)"


class ForkedWorker:
    """A rank's worker forked from the task process, which has imported torch already:
    starts in milliseconds instead of paying the torch import (seconds) on every run. The
    child leads its own session, keeps only stdin/stdout/stderr, and dies with its parent."""

    def __init__(self, workdir: str, env: Dict[str, str]):
        # warm imports the child reuses; torch._dynamo: the first torch.optim optimizer a process
        # builds imports it (about a second), here once per Python worker, not in every rank
        import cloudpickle  # noqa: F401
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401

        import sparkring.collective  # noqa: F401

        try:  # rank 0 of a fit writes TensorBoard scalars where it is installed (0.2 s to import)
            import torch.utils.tensorboard  # noqa: F401
        except Exception:  # noqa: BLE001 - optional; its own import errors are the rank's to meet
            pass

        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        inherited = open_files()
        pid = os.fork()
        if pid == 0:  # child
            try:
                os.setsid()
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                release_inherited(inherited, null)
                for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE):
                    signal.signal(sig, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                os.environ.clear()
                os.environ.update(env)
                import io

                sys.stdin = open(0, "r", closefd=False)
                sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
                sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
                from .worker import main

                main(workdir)
            finally:
                os._exit(1)
        os.close(out_w)
        os.close(err_w)
        self.pid = pid
        self.stdout = os.fdopen(out_r, "rb")
        self.stderr = os.fdopen(err_r, "rb")
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        """The exit code; None while it runs (as Popen's)."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the exit, at most ``timeout`` seconds (TimeoutExpired after); the exit code."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            if timeout is not None and deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.02)


def open_files() -> Dict[int, Tuple[int, int]]:
    """This process's open file descriptors and the file each refers to (device, inode)."""
    files = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            files[int(name)] = _file_of(int(name))
        except OSError:  # the descriptor listdir itself used
            continue
    return files


def _file_of(fd: int) -> Tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def release_inherited(inherited: Dict[int, Tuple[int, int]], null: int) -> None:
    """In a forked child: let go of the parent's files (the Spark worker's sockets, which must
    see EOF when the worker ends) by pointing their descriptors at /dev/null, not closing them.

    The child also inherits the Python objects that own those descriptors (socket and file
    objects, a finalizer's fd); when one is collected it closes "its" number. Had we closed the
    number, the child would have reused it by then (libuv's signal pipe in the TCPStore server
    of rank 0 was the one seen), and the stale close would take it away: libuv aborts (SIGABRT).
    A /dev/null descriptor keeps the number taken. Descriptors that fork handlers made anew
    in the child (another inode under a number the parent used) are left alone."""
    for fd, identity in inherited.items():
        if fd <= 2 or fd == null:
            continue
        try:
            if _file_of(fd) == identity:
                os.dup2(null, fd, inheritable=False)
        except OSError:
            pass


def describe_exit(code: Optional[int]) -> str:
    """How a worker process ended, in words; a SIGKILL names its usual cause.

    >>> describe_exit(-9)[:40]
    'was killed by signal 9 (SIGKILL): on a b'
    """
    if code is None:
        return "did not exit"
    # a negative code is a signal (Popen, waitstatus); 128+N is a signal relayed by a shell or mpiexec
    sig = -code if code < 0 else (code - 128 if 128 < code < 160 else None)
    if sig is None:
        return f"exited with code {code}"
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    text = f"was killed by signal {sig} ({name})"
    if sig == signal.SIGKILL:
        text += (": on a busy host that is most often the kernel's out-of-memory killer (see dmesg); give "
                 "executors more memory (spark.executor.memory, spark.executor.pyspark.memory) or lower "
                 "batchSize")
    return text


def start_worker(workdir: str, env: Dict[str, str]):
    """Fork or spawn a fresh interpreter (:func:`sparkring.process_start.start_method`); MPI ranks always start
    fresh under ``mpiexec -n 1``, which MPI_Init needs."""
    command = [sys.executable, "-m", WORKER_MODULE, workdir]
    place = environment.RankEnv.from_env(env)
    if transport(place.backend).starts_under_mpiexec:
        mpiexec = find_mpiexec()
        if mpiexec is None:
            raise RuntimeError("backend='mpi': no mpiexec on this executor; pip install 'sparkring[mpi]'")
        command = [mpiexec, "-n", "1"] + command
    else:
        start = start_method(uses_gpu=place.gpu is not None, env=env)
        log_if_spawning(f"rank {place.rank}'s worker", start)
        if start.forks:
            return ForkedWorker(workdir, env)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)
