"""The body of one barrier task: rendezvous, start the rank's worker process, relay its
output and result, and kill it when the run is aborted or times out."""
from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

from ..collective import _env
from . import channel

WORKER_MODULE = "sparkring.runner._worker"


@dataclass
class TaskSpec:
    payload: bytes
    driver_host: str
    driver_port: int
    secret: bytes
    num_proc: int
    backend: str
    use_gpu: bool
    driver_gpus: List[str]
    start_timeout: float
    timeout: Optional[float]
    env: Dict[str, str] = field(default_factory=dict)
    task_cpus: int = 1
    chunk_bytes: int = 8 * 1024 * 1024


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def interface_of(ip: str) -> Optional[str]:
    """Name of the network interface that holds ``ip`` (gloo/nccl bind to it)."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == ip for a in addrs):
                return name
    except Exception:  # noqa: BLE001 - best effort; the library default applies
        pass
    return None


def free_port(ip: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


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


def _dump_stacks(proc, workdir: str) -> str:
    """Ask the worker for its Python stacks (faulthandler on SIGUSR1) before killing it."""
    path = os.path.join(workdir, "stacks.txt")
    try:
        with open(os.path.join(workdir, "pid")) as f:
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
        import cloudpickle  # noqa: F401 - warm imports the child reuses
        import torch  # noqa: F401

        import sparkring.collective  # noqa: F401

        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            try:
                os.setsid()
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                keep = {0, 1, 2}
                for name in os.listdir("/proc/self/fd"):
                    fd = int(name)
                    if fd not in keep:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE):
                    signal.signal(sig, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                os.environ.clear()
                os.environ.update(env)
                import io

                sys.stdin = open(0, "r", closefd=False)
                sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
                sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
                from ._worker import main

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
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


def find_mpiexec() -> Optional[str]:
    """MPICH's fork-only launcher next to this interpreter (the mpich wheel puts it there):
    it talks to its one process over a socketpair, where hydra's mpiexec listens on every
    interface. Any ``mpiexec`` on PATH otherwise."""
    here = os.path.dirname(sys.executable)
    for name in ("mpiexec.gforker", "mpiexec"):
        found = shutil.which(name, path=os.pathsep.join([here, os.environ.get("PATH", "")]))
        if found:
            return found
    return None


def mpi_network_env(iface: Optional[str], ip: str) -> Dict[str, str]:
    """Keep MPI's own listeners on the task's interface (loopback in local mode)."""
    env = {"MPIR_CVAR_CH3_INTERFACE_HOSTNAME": ip}
    if iface:
        env.update({"UCX_NET_DEVICES": iface, "FI_TCP_IFACE": iface, "FI_SOCKETS_IFACE": iface})
    return env


def start_worker(workdir: str, env: Dict[str, str]):
    """Fork (Linux, default) or spawn a fresh interpreter (SPARKRING_WORKER_START=spawn);
    MPI ranks always start fresh under ``mpiexec -n 1``, which MPI_Init needs."""
    command = [sys.executable, "-m", WORKER_MODULE, workdir]
    if env.get(_env.BACKEND) == "mpi":
        mpiexec = find_mpiexec()
        if mpiexec is None:
            raise RuntimeError("backend='mpi': no mpiexec on this executor; pip install 'sparkring[mpi]'")
        command = [mpiexec, "-n", "1"] + command
    else:
        mode = env.get("SPARKRING_WORKER_START", "fork" if sys.platform.startswith("linux") else "spawn")
        if mode == "fork":
            return ForkedWorker(workdir, env)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _rank_layout(hosts: List[str], rank: int):
    same_host = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    unique_hosts = list(dict.fromkeys(hosts))
    return (same_host.index(rank), len(same_host), unique_hosts.index(hosts[rank]), len(unique_hosts))


def _pump(stream, conn: channel.Connection, rank: int, attempt: int, name: str, tail) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        tail.append(line)
        conn.send({"t": "log", "rank": rank, "attempt": attempt, "stream": name, "line": line})
    stream.close()


def run_task(spec: TaskSpec, _rows) -> Iterator:
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    rank = ctx.partitionId()
    hosts = [info.address.rsplit(":", 1)[0].strip("[]") for info in ctx.getTaskInfos()]
    my_ip = _resolve(hosts[rank])
    conn = channel.connect(spec.driver_host, spec.driver_port, spec.secret, timeout=spec.start_timeout)
    conn.send({"t": "arrived", "rank": rank})
    port = free_port(my_ip) if rank == 0 else None
    gathered = [json.loads(m) for m in ctx.allGather(json.dumps({"port": port, "tid": ctx.taskAttemptId()}))]
    port = gathered[0]["port"]
    # Every task of one stage attempt computes the same key; a retried stage gets a larger one.
    attempt = min(g["tid"] for g in gathered)
    conn.send({"t": "hello", "rank": rank, "attempt": attempt, "host": hosts[rank]})
    local_rank, local_size, cross_rank, cross_size = _rank_layout(hosts, rank)

    env = dict(os.environ)
    env.update({k: str(v) for k, v in spec.env.items()})
    master_ip = _resolve(hosts[0])
    env.update({
        _env.RANK: str(rank), _env.SIZE: str(spec.num_proc),
        _env.LOCAL_RANK: str(local_rank), _env.LOCAL_SIZE: str(local_size),
        _env.CROSS_RANK: str(cross_rank), _env.CROSS_SIZE: str(cross_size),
        _env.MASTER_ADDR: master_ip, _env.MASTER_PORT: str(port), _env.BACKEND: spec.backend,
        # torch.distributed's own names, for code that reads them directly
        "RANK": str(rank), "WORLD_SIZE": str(spec.num_proc), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size), "MASTER_ADDR": master_ip, "MASTER_PORT": str(port),
        "SPARKRING_DRIVER": f"{spec.driver_host}:{spec.driver_port}",
        "SPARKRING_SECRET": spec.secret.hex(), "SPARKRING_ATTEMPT": str(attempt),
        "SPARKRING_START_TIMEOUT": str(spec.start_timeout),
        "SPARKRING_PARENT_PID": str(os.getpid()),
        # Everything this task can import, the worker can import (py-files, zips, tests).
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "PYTHONUNBUFFERED": "1",
    })
    iface = interface_of(my_ip)
    if iface:
        env.setdefault("GLOO_SOCKET_IFNAME", iface)
        env.setdefault("NCCL_SOCKET_IFNAME", iface)
    if spec.backend == "mpi":
        for key, value in mpi_network_env(iface, my_ip).items():
            env.setdefault(key, value)
    env.setdefault("OMP_NUM_THREADS", str(max(1, spec.task_cpus)))
    if spec.use_gpu:
        resources = ctx.resources()
        if "gpu" in resources and resources["gpu"].addresses:
            gpus = list(resources["gpu"].addresses)
        elif spec.driver_gpus:
            gpus = [spec.driver_gpus[local_rank % len(spec.driver_gpus)]]
        else:
            gpus = []
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    else:
        env.setdefault("CUDA_VISIBLE_DEVICES", "")

    workdir = tempfile.mkdtemp(prefix=f"sparkring-rank{rank}-")
    aborted: Dict[str, str] = {}
    proc = None
    try:
        with open(os.path.join(workdir, "payload.pkl"), "wb") as f:
            f.write(spec.payload)
        proc = start_worker(workdir, env)
        conn.send({"t": "started", "rank": rank, "attempt": attempt, "pid": proc.pid})
        tail: collections.deque = collections.deque(maxlen=40)
        pumps = [threading.Thread(target=_pump, args=(s, conn, rank, attempt, n, tail), daemon=True)
                 for s, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
        for p in pumps:
            p.start()

        def listen():
            try:
                while True:
                    msg = channel.recv_frame(conn.sock, spec.secret)
                    if msg is None:
                        return
                    if msg.get("t") == "abort":
                        aborted["reason"] = msg.get("reason", "the run was aborted")
                        if msg.get("dump"):
                            conn.send({"t": "stacks", "rank": rank, "attempt": attempt,
                                       "stacks": _dump_stacks(proc, workdir)})
                        kill_tree(proc)
                        return
            except (OSError, channel.ChannelError, ValueError):
                return

        threading.Thread(target=listen, daemon=True).start()
        started = time.monotonic()
        timed_out = False
        while proc.poll() is None:
            if spec.timeout is not None and time.monotonic() - started > spec.timeout:
                timed_out = True
                stacks = _dump_stacks(proc, workdir)
                kill_tree(proc)
                break
            time.sleep(0.05)
        for p in pumps:
            p.join(timeout=5)
        if timed_out:
            message = (f"rank {rank} exceeded timeout={spec.timeout:g}s and was killed; "
                       f"where its threads were:\n{stacks}")
            conn.send({"t": "error", "rank": rank, "attempt": attempt, "kind": "timeout",
                       "traceback": message})
            raise TimeoutError(message)
        if aborted:
            raise RuntimeError(f"rank {rank} was stopped: {aborted['reason']}")
        if proc.returncode != 0:
            err_path = os.path.join(workdir, "error.txt")
            if os.path.exists(err_path):
                with open(err_path) as f:
                    tb = f.read()
            else:
                tb = (f"worker process exited with code {proc.returncode}; last output:\n"
                      + "\n".join(tail))
            conn.send({"t": "error", "rank": rank, "attempt": attempt, "kind": "exit",
                       "exit_code": proc.returncode, "traceback": tb})
            raise RuntimeError(f"rank {rank} failed:\n{tb}")
        with open(os.path.join(workdir, "result.pkl"), "rb") as f:
            result = f.read()
        conn.send({"t": "done", "rank": rank, "attempt": attempt})
        total = max(1, -(-len(result) // spec.chunk_bytes))
        for i in range(total):
            yield (rank, i, total, result[i * spec.chunk_bytes:(i + 1) * spec.chunk_bytes])
    finally:
        if proc is not None and proc.poll() is None:
            kill_tree(proc)
        elif proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything the worker left behind
            except (ProcessLookupError, PermissionError):
                pass
        conn.close()
        shutil.rmtree(workdir, ignore_errors=True)
