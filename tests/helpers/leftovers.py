"""What a run may leave behind, measured with psutil: rank workers, mpiexec, threads, open
files and listening sockets of the driver and of its executors (the JVMs and Python workers
it started)."""
import threading
import time
from dataclasses import dataclass

import psutil


def live_workers():
    """Rank workers still alive: the pids the last run reported, plus anything named like one."""
    from sparkring.runner.driver.launch import last_worker_pids

    alive = set()
    for pid in last_worker_pids():
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        name, cmdline = p.info.get("name") or "", p.info.get("cmdline") or []
        if p.info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        if (name.startswith("sparkring-r") or "sparkring.runner.task.worker" in cmdline
                or name in ("mpiexec", "hydra_pmi_proxy")):
            alive.add(p.pid)
    return sorted(alive)


def wait_no_workers(timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline and live_workers():
        time.sleep(0.2)
    return live_workers()


@dataclass(frozen=True)
class Footprint:
    """Counts that must not grow from one run to the next."""

    driver_threads: int       # Python threads of this process
    driver_fds: int           # open file descriptors of this process
    driver_listening: int     # listening TCP sockets of this process
    listening: int            # listening TCP sockets of this process and every process under it
    processes: int            # live processes under this one (JVMs, Python workers, ranks)
    workers: int              # rank workers and mpiexec anywhere on the machine

    def grown(self, before: "Footprint", slack_fds: int = 0, fields=None):
        """The ``fields`` (default: all) that grew since ``before``; file descriptors allow ``slack_fds``."""
        names = fields or tuple(self.__dataclass_fields__)
        return {name: (getattr(before, name), getattr(self, name)) for name in names
                if getattr(self, name) > getattr(before, name) + (slack_fds if name == "driver_fds" else 0)}


def footprint() -> Footprint:
    me = psutil.Process()
    tree = [me] + me.children(recursive=True)
    listening = [_listening(p) for p in tree]
    alive = [p for p in tree[1:] if _alive(p)]
    return Footprint(driver_threads=threading.active_count(), driver_fds=me.num_fds(),
                     driver_listening=listening[0], listening=sum(listening), processes=len(alive),
                     workers=len(live_workers()))


def settled_footprint(before: Footprint, timeout=15, slack_fds=0, fields=None) -> Footprint:
    """The footprint once threads and processes of the last run had time to end (or ``timeout``)."""
    deadline = time.time() + timeout
    now = footprint()
    while now.grown(before, slack_fds, fields) and time.time() < deadline:
        time.sleep(0.5)
        now = footprint()
    return now


def _listening(p) -> int:
    try:
        return sum(1 for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


def _alive(p):
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def ctrl_c_when_ranks_run(count=2, timeout=90):
    """Send this process SIGINT (what Ctrl-C does) once ``count`` rank workers run; returns the thread."""
    import os
    import signal

    def wait_then_interrupt():
        deadline = time.time() + timeout
        while time.time() < deadline:
            ranks = [p for p in psutil.process_iter(["name"]) if (p.info.get("name") or "").startswith("sparkring-r")]
            if len(ranks) >= count:
                time.sleep(1.0)  # inside training, past the start-up
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=wait_then_interrupt, daemon=True)
    thread.start()
    return thread
