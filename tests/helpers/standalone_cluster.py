"""A Spark standalone cluster started from the installed pyspark for a test: a master on
127.0.0.1 and workers that each listen on a loopback address of their own (127.0.0.2, ...)
and whose executors say so (SPARKRING_HOST_ID), so they are distinct hosts to sparkring while
every byte stays on this machine. Workers can be killed (daemon, executors and their Python) and started again."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import psutil
import pyspark

SPARK_HOME = os.path.dirname(os.path.abspath(pyspark.__file__))
SPARK_CLASS = os.path.join(SPARK_HOME, "bin", "spark-class")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def alive_workers(ui_port: int) -> int:
    """The workers a standalone master's UI counts alive; 0 while the UI is not up (a starting UI
    can answer /json/ with its HTML page before the JSON handler is attached)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as r:
            return json.load(r).get("aliveworkers", 0)
    except (OSError, ValueError):
        return 0


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise TimeoutError(what)


def processes_under(root) -> List[int]:
    """Master, workers, executors and their Python workers/ranks still running for a cluster
    whose directories are under ``root``."""
    found = []
    for p in psutil.process_iter(["cmdline", "cwd", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            text = " ".join(p.info["cmdline"] or []) + " " + (p.info["cwd"] or "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if str(root) in text:
            found.append(p.pid)
    return found


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, wait: float = 20) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@dataclass
class Worker:
    host: str
    cores: int
    work_dir: str
    proc: Optional[subprocess.Popen] = None


@dataclass
class StandaloneCluster:
    """``StandaloneCluster(root, env).start(["127.0.0.2", "127.0.0.3"], cores=2)`` then
    ``.master`` for a SparkSession; ``kill_worker(i)``/``start_worker(i)``; ``stop()``."""

    root: str
    env: Dict[str, str]
    worker_memory: str = "1500m"
    master_port: int = 0
    ui_port: int = 0
    master_proc: Optional[subprocess.Popen] = None
    workers: List[Worker] = field(default_factory=list)
    _logs: list = field(default_factory=list)

    @property
    def master(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    def _spawn(self, args: List[str], log_name: str, **env: str) -> subprocess.Popen:
        log = open(os.path.join(self.root, log_name), "a")
        self._logs.append(log)
        return subprocess.Popen([SPARK_CLASS, *args], env={**self.env, "SPARK_NO_DAEMONIZE": "1", **env}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root)

    def start(self, hosts: List[str], cores: int) -> "StandaloneCluster":
        self.master_port, self.ui_port = free_port(), free_port()
        self.master_proc = self._spawn(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port",
                                        str(self.master_port), "--webui-port", str(self.ui_port)], "master.log",
                                       SPARK_LOCAL_IP="127.0.0.1")
        wait_for(lambda: port_open(self.master_port), 60, "the master did not start")
        for i, host in enumerate(hosts):
            work = os.path.join(self.root, f"work{i}")
            os.makedirs(work, exist_ok=True)
            self.workers.append(Worker(host, cores, work))
            self.start_worker(i, wait=False)
        wait_for(lambda: self.alive_workers() == len(hosts), 90, "the workers did not register")
        return self

    def start_worker(self, i: int, wait: bool = True) -> None:
        w = self.workers[i]
        w.proc = self._spawn(["org.apache.spark.deploy.worker.Worker", "--host", w.host, "--cores", str(w.cores),
                              "--memory", self.worker_memory, "--webui-port", str(free_port(w.host)),
                              "--work-dir", w.work_dir, self.master], f"worker{i}.log", SPARK_LOCAL_IP=w.host,
                             # executors reach the driver from 127.0.0.1 whatever they bind: Spark names
                             # them all by that address, so each worker's executors say which host they are
                             SPARKRING_HOST_ID=w.host)
        if wait:
            expected = sum(1 for x in self.workers if x.proc is not None)
            wait_for(lambda: self.alive_workers() == expected, 90, f"worker {w.host} did not register")

    def decommission_worker(self, i: int) -> None:
        """SIGPWR, as Spark's decommission-worker.sh sends: with spark.decommission.enabled the
        worker decommissions its executors (they finish their tasks, get no new ones, then exit)."""
        w = self.workers[i]
        assert w.proc is not None
        os.kill(w.proc.pid, signal.SIGPWR)

    def kill_worker(self, i: int) -> None:
        """The worker daemon and everything it started (executors, their Python workers and
        ranks) die at once, as a lost machine's would."""
        w = self.workers[i]
        doomed = [p for p in map(_process, processes_under(w.work_dir)) if p is not None]
        if w.proc is not None:
            doomed.append(_process(w.proc.pid))
        for p in doomed:
            if p is None:
                continue
            try:
                for child in p.children(recursive=True):
                    child.kill()
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if w.proc is not None:
            w.proc.wait(20)
            w.proc = None

    def alive_workers(self) -> int:
        return alive_workers(self.ui_port)

    def stop(self) -> None:
        for w in self.workers:
            if w.proc is not None:
                _stop(w.proc)
                w.proc = None
        if self.master_proc is not None:
            _stop(self.master_proc)
            self.master_proc = None
        for log in self._logs:
            log.close()
        wait_for(lambda: not processes_under(self.root), 30, "cluster processes outlived the test")


def _process(pid: int) -> Optional[psutil.Process]:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
