"""Simulated hosts on this machine, for tests and benchmarks: each host is a network namespace
with its own hostname (UTS namespace) and its own /dev/shm (mount namespace), joined to the
others by a veth into one bridge, its link shaped by tc (a rate, each way; cut, or every packet
dropped, on demand); a Spark standalone worker runs on each, the master and the driver in a head
namespace on the same bridge.

Addresses come from 198.18.0.0/15 (reserved for benchmarking networks) and exist only inside
the namespaces made here: nothing is added to this machine's own network. Everything is torn
down by ``stop()``; what a killed run left (namespaces named ``srsim-*`` and their processes) is
removed by the next ``start()``. Needs root and iproute2 (``why_not()`` says what is missing).

    hosts = SimulatedHosts(2, Link(rate="1gbit")).start()
    cluster = hosts.spark_cluster(root=str(tmp_path), env=dict(os.environ), cores=2)
    result = cluster.drive("layout", {"floats": 1000, "ranks": 4})  # sim_driver.py on the head
    hosts.cut(1)   # host 1's link down (its port on the bridge), as a pulled cable
    hosts.stop()
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pyspark

PREFIX = "srsim"
NET = "198.18.0"
HEAD_ADDRESS = f"{NET}.2"
SPARK_CLASS = os.path.join(os.path.dirname(os.path.abspath(pyspark.__file__)), "bin", "spark-class")
# Inside a host: its hostname, a private tmpfs on /dev/shm, then the command.
# A host of its own: its hostname, its /dev/shm, and its boot id (UCX takes processes that share
# a boot id for one machine and reaches them through shared memory, which is not shared here).
_ENTER_HOST = ('hostname "$SRSIM_HOSTNAME" && mount -t tmpfs -o size=2g tmpfs /dev/shm'
               ' && cat /proc/sys/kernel/random/uuid > /dev/shm/.boot_id'
               ' && mount --bind /dev/shm/.boot_id /proc/sys/kernel/random/boot_id && exec "$@"')


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def why_not() -> Optional[str]:
    """Why hosts cannot be simulated here (None: they can)."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"simulated hosts need {tool} (iproute2, util-linux)"
    probe = f"{PREFIX}-probe"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    return None if made.returncode == 0 else f"cannot make a network namespace: {made.stderr.strip()}"


def remove_leftovers() -> List[str]:
    """Namespaces of earlier runs (``srsim-*``) with every process in them: killed and removed."""
    names = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
             if line.startswith(PREFIX + "-")]
    for name in names:
        _kill_inside(name)
        _ip("netns", "del", name, check=False)
    return names


def _kill_inside(namespace: str) -> None:
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


@dataclass(frozen=True)
class Link:
    """A host's link, the same each way, at ``rate`` as tc spells it ("1gbit", "100mbit"). Shaped
    by tc's token bucket (tbf): this machine's kernel has no netem, so no delay or random loss;
    ``SimulatedHosts.drop`` drops every packet another way.

    >>> Link("10gbit").bytes_per_second
    1250000000.0
    """

    rate: str = "1gbit"

    @property
    def bytes_per_second(self) -> float:
        """The rate in bytes per second."""
        number, unit = self.rate[:-4], self.rate[-4:]
        return float(number) * _UNITS[unit] / 8

    def tbf(self) -> List[str]:
        """tc's tbf arguments: a bucket of 2 ms at the rate (at least 256 KiB: offloaded segments
        reach 64 KiB), a queue of 20 ms."""
        burst = max(256 * 1024, int(self.bytes_per_second * 0.002))
        return ["tbf", "rate", self.rate, "burst", str(burst), "latency", "20ms"]


@dataclass
class SimulatedHosts:
    """``count`` hosts behind one bridge, each link ``link``; host ``i`` is reached at ``address(i)``."""

    count: int
    link: Link = field(default_factory=Link)
    links: Dict[int, Link] = field(default_factory=dict)
    procs: List[subprocess.Popen] = field(default_factory=list)
    _logs: list = field(default_factory=list)

    switch = f"{PREFIX}-switch"
    head = f"{PREFIX}-head"

    def namespace(self, i: int) -> str:
        """Host ``i``'s network namespace."""
        return f"{PREFIX}-host{i}"

    def hostname(self, i: int) -> str:
        """Host ``i``'s hostname (what its processes' platform.node() says)."""
        return f"simhost{i}"

    def address(self, i: int) -> str:
        """Host ``i``'s address on the bridge."""
        return f"{NET}.{11 + i}"

    def port(self, i: int) -> str:
        """Host ``i``'s port on the bridge (in the switch namespace)."""
        return f"port{i}"

    def start(self) -> "SimulatedHosts":
        """Make the bridge, the head and the hosts (removing what a killed run left first)."""
        remove_leftovers()
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        self._plug(self.head, "porthead", HEAD_ADDRESS)
        for i in range(self.count):
            self._plug(self.namespace(i), self.port(i), self.address(i))
            self.shape(i, self.link)
        return self

    def _plug(self, namespace: str, port: str, address: str) -> None:
        _ip("netns", "add", namespace)
        _ip("link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")

    def shape(self, i: int, link: Link) -> None:
        """Host ``i``'s link becomes ``link``, both ways (its side and the bridge's side)."""
        self.links[i] = link
        for namespace, device in ((self.namespace(i), "eth0"), (self.switch, self.port(i))):
            subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root",
                            *link.tbf()], check=True, capture_output=True)

    def cut(self, i: int) -> None:
        """Host ``i``'s link goes down (its port on the bridge): nothing in or out, no reset sent."""
        _ip("-n", self.switch, "link", "set", self.port(i), "down")

    def drop(self, i: int) -> None:
        """Every packet between host ``i`` and the others is discarded, its link up: a blackhole
        rule on host ``i`` for the whole network and on every other host and the head for it."""
        _ip("-n", self.namespace(i), "rule", "add", "prio", "10", "to", f"{NET}.0/24", "blackhole")
        for other in self._others(i):
            _ip("-n", other, "rule", "add", "prio", "10", "to", self.address(i), "blackhole")

    def _others(self, i: int) -> List[str]:
        return [self.head] + [self.namespace(j) for j in range(self.count) if j != i]

    def heal(self, i: int) -> None:
        """Host ``i``'s link up again and nothing dropped."""
        _ip("-n", self.switch, "link", "set", self.port(i), "up")
        _ip("-n", self.namespace(i), "rule", "del", "prio", "10", check=False)
        for other in self._others(i):
            _ip("-n", other, "rule", "del", "prio", "10", "to", self.address(i), check=False)

    def bytes_through(self, i: int) -> int:
        """Bytes host ``i``'s link carried so far, both ways (its bridge port's counters)."""
        total = 0
        for direction in ("rx_bytes", "tx_bytes"):
            path = f"/sys/class/net/{self.port(i)}/statistics/{direction}"
            total += int(subprocess.run(["ip", "netns", "exec", self.switch, "cat", path], capture_output=True,
                                        text=True, check=True).stdout)
        return total

    def on_host(self, i: int, argv: List[str]) -> List[str]:
        """``argv`` as run on host ``i``: its network, its hostname, its own /dev/shm."""
        return ["ip", "netns", "exec", self.namespace(i), "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", _ENTER_HOST, "sh", *argv]

    def on_head(self, argv: List[str]) -> List[str]:
        """``argv`` as run on the head (the master's and the driver's host)."""
        return ["ip", "netns", "exec", self.head, *argv]

    def spawn(self, argv: List[str], log_path: str, env: Dict[str, str],
              host: Optional[int] = None) -> subprocess.Popen:
        """A process on host ``host`` (None: the head), its output in ``log_path``; stopped by stop()."""
        log = open(log_path, "a")
        self._logs.append(log)
        wrapped = self.on_head(argv) if host is None else self.on_host(host, argv)
        extra = {} if host is None else {"SRSIM_HOSTNAME": self.hostname(host)}
        proc = subprocess.Popen(wrapped, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def spark_cluster(self, root: str, env: Dict[str, str], cores: int = 1,
                      worker_memory: str = "1500m") -> "SimulatedCluster":
        """A standalone master on the head and one worker on every host, all registered."""
        return SimulatedCluster(self, root, env, cores, worker_memory).start()

    def stop(self) -> None:
        """Every process in the namespaces, then the namespaces themselves."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for namespace in [self.head, self.switch] + [self.namespace(i) for i in range(self.count)]:
            _kill_inside(namespace)
            _ip("netns", "del", namespace, check=False)
        for proc in self.procs:
            proc.wait(30)
        for log in self._logs:
            log.close()


@dataclass
class SimulatedCluster:
    """A Spark standalone cluster on simulated hosts: ``master`` is its URL from the head."""

    hosts: SimulatedHosts
    root: str
    env: Dict[str, str]
    cores: int
    worker_memory: str
    master_port: int = 7077
    workers: Dict[int, subprocess.Popen] = field(default_factory=dict)

    @property
    def master(self) -> str:
        return f"spark://{HEAD_ADDRESS}:{self.master_port}"

    def start(self) -> "SimulatedCluster":
        os.makedirs(self.root, exist_ok=True)
        env = {**self.env, "SPARK_NO_DAEMONIZE": "1"}
        self.hosts.spawn([SPARK_CLASS, "org.apache.spark.deploy.master.Master", "--host", HEAD_ADDRESS, "--port",
                          str(self.master_port), "--webui-port", "8080"], os.path.join(self.root, "master.log"),
                         {**env, "SPARK_LOCAL_IP": HEAD_ADDRESS})
        for i in range(self.hosts.count):
            self.start_worker(i, wait=False)
        self.wait_registered(self.hosts.count, timeout=120)
        return self

    def start_worker(self, i: int, wait: bool = True) -> None:
        """A standalone worker on host ``i`` (again, after kill_worker), registered when ``wait``."""
        registered = self._registrations()
        work = os.path.join(self.root, f"work{i}")
        os.makedirs(work, exist_ok=True)
        address = self.hosts.address(i)
        env = {**self.env, "SPARK_NO_DAEMONIZE": "1", "SPARK_LOCAL_IP": address}
        self.workers[i] = self.hosts.spawn(
            [SPARK_CLASS, "org.apache.spark.deploy.worker.Worker", "--host", address, "--cores", str(self.cores),
             "--memory", self.worker_memory, "--webui-port", "8081", "--work-dir", work, self.master],
            os.path.join(self.root, f"worker{i}.log"), env, host=i)
        if wait:
            self.wait_registered(registered + 1, timeout=120)

    def kill_worker(self, i: int) -> None:
        """Host ``i``'s worker killed with its executors (their process group), the host still on the network."""
        os.killpg(self.workers[i].pid, signal.SIGKILL)
        self.workers[i].wait(30)

    def _registrations(self) -> int:
        with open(os.path.join(self.root, "master.log")) as f:
            return f.read().count("Registering worker")

    def wait_registered(self, count: int, timeout: float) -> None:
        """Until the master's log says ``count`` registrations of workers (counting those again after a kill)."""
        log = os.path.join(self.root, "master.log")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._registrations() >= count:
                return
            time.sleep(0.5)
        raise TimeoutError(f"fewer than {count} workers registered within {timeout:g}s (see {log})")

    def wait_idle(self, timeout: float) -> None:
        """Until the master (its JSON page, read from the head) has a live worker on every host, no core
        taken: after a cut is healed a worker may still hold an ended application's executor a while."""
        read = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
        page = f"http://{HEAD_ADDRESS}:8080/json/"
        deadline, workers = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            done = subprocess.run(self.hosts.on_head([sys.executable, "-c", read, page]), capture_output=True,
                                  text=True)
            if done.returncode == 0:
                workers = [w for w in json.loads(done.stdout)["workers"] if w["state"] == "ALIVE"]
                idle = {w["host"] for w in workers if w["coresused"] == 0}
                if idle >= {self.hosts.address(i) for i in range(self.hosts.count)}:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"not every host had an idle live worker within {timeout:g}s: {workers}")

    def drive(self, scenario: str, args: Dict[str, Any], master: Optional[str] = None,
              on_line: Optional[Callable[[str], None]] = None, timeout: float = 600) -> Dict[str, Any]:
        """Run ``scenario`` of sim_driver.py on the head (on this cluster, or ``master``): the
        JSON it prints; ``on_line`` sees every other line as it comes."""
        driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sim_driver.py")
        argv = [sys.executable, driver, master or self.master, scenario, json.dumps(args)]
        env = {k: v for k, v in self.env.items() if not k.startswith("SPARK_LOCAL")}
        proc = subprocess.Popen(self.hosts.on_head(argv), env={**env, "SPARK_LOCAL_IP": HEAD_ADDRESS},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        result, tail = None, []
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = (tail + [line])[-40:]
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
            elif on_line is not None:
                on_line(line)
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"{scenario} ran past {timeout:g}s:\n" + "".join(tail))
        if proc.wait(60) != 0 or result is None:
            raise RuntimeError(f"{scenario} failed (exit {proc.returncode}):\n" + "".join(tail))
        return result

    def elastic_fit_losing_host(self, i: int, how: str, store: str, heartbeat_timeout: float) -> "HostLoss":
        """sim_driver's elastic scenario (4 ranks, 2 a host), host ``i`` lost once the fit's checkpoint at
        step 4 of epoch 1 is written (``how``: "cut" its link, "kill_worker" its worker and executor),
        then the cluster whole again: what the fit returned and when the driver said what."""
        loss, done = HostLoss(), threading.Event()

        def lose_host_at_the_checkpoint():
            while not done.is_set() and not any(Path(store).rglob("*epoch-00001-step-0000004*")):
                done.wait(0.05)
            if not done.is_set():
                (self.hosts.cut if how == "cut" else self.kill_worker)(i)
                loss.lost_at = time.time()

        def note(line):
            for mark, attribute in (("going on with 2 of 4 ranks", "going_on_at"), ("resuming from", "resumed_at")):
                if mark in line and getattr(loss, attribute) is None:
                    setattr(loss, attribute, time.time())

        watcher = threading.Thread(target=lose_host_at_the_checkpoint, daemon=True)
        watcher.start()
        try:
            loss.result = self.drive("elastic", {"pace": 0.1, "store": store, "run_id": how, "start_timeout": 20,
                                                 "heartbeat_timeout": heartbeat_timeout}, on_line=note)
        finally:
            done.set()
            watcher.join()
            if how == "cut":
                self.hosts.heal(i)
            else:
                self.start_worker(i)
            self.wait_idle(timeout=120)
        return loss


@dataclass
class HostLoss:
    """An elastic fit that lost a host: its result, the second the host was lost, and the seconds the
    driver said it goes on with the ranks left and the ranks said they resume from the checkpoint."""

    result: Dict[str, Any] = field(default_factory=dict)
    lost_at: Optional[float] = None
    going_on_at: Optional[float] = None
    resumed_at: Optional[float] = None
