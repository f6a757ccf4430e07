"""What one doctor task finds on its executor: Python and package versions, GPUs, /dev/shm,
MPI, NCCL, whether the driver is reachable and whether the Store can be written. It imports nothing of sparkring, and
the doctor
ships it by value (cloudpickle), so it runs on executors where sparkring is not installed."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

PACKAGES = ("sparkring", "torch", "cloudpickle", "pyarrow")


@dataclass
class TaskFacts:
    """One task's findings (what probe() returns, as JSON from the executor to the driver)."""

    executor: str                   # host:port of the executor, as Spark names it
    hostname: str
    python_executable: str
    versions: Dict[str, str]        # python and PACKAGES; "missing" where not importable
    cpu_count: int
    gpus_assigned: List[str] = field(default_factory=list)
    gpus_visible: Optional[int] = None   # torch.cuda.device_count(); None without torch
    nccl: bool = False
    shm_free_bytes: Optional[int] = None  # None where there is no /dev/shm
    mpiexec: Optional[str] = None
    mpi4py: bool = False
    driver_reachable: bool = False
    driver_error: str = ""
    errors: List[str] = field(default_factory=list)
    store_error: Optional[str] = None   # None: not checked; "": written, read back and removed

    @classmethod
    def from_json(cls, text: str) -> "TaskFacts":
        return cls(**json.loads(text))


def find_mpiexec() -> Optional[str]:
    """MPICH's fork-only launcher next to this interpreter (the mpich wheel puts it there):
    it talks to its one process over a socketpair, where hydra's mpiexec listens on every
    interface. Any ``mpiexec`` on PATH otherwise. (Here so that the doctor's probe, which
    carries this module by value, finds it as the launch does.)"""
    here = os.path.dirname(sys.executable)
    for name in ("mpiexec.gforker", "mpiexec"):
        found = shutil.which(name, path=os.pathsep.join([here, os.environ.get("PATH", "")]))
        if found:
            return found
    return None


def mpi_library() -> Optional[str]:
    """The MPI library mpi4py runs on, as it names itself ("MPICH Version: 4.3.0 ...", "Open MPI
    v4.1.6 ..."), read in a child interpreter: importing mpi4py.MPI here would initialise MPI in
    this process. None where mpi4py is missing or does not load."""
    code = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(MPI.Get_library_version().splitlines()[0])")
    try:
        found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found.stdout.strip() if found.returncode == 0 and found.stdout.strip() else None


def installed_version(name: str) -> str:
    """The version of ``name`` this interpreter would import: "missing" where it is not there,
    sparkring's own from its code (it may arrive as --py-files, without metadata). The one
    version reader of the project (this module travels by value, so it imports nothing of it)."""
    if name == "python":
        return platform.python_version()
    if importlib.util.find_spec(name) is None:
        return "missing"
    if name == "sparkring":
        try:  # the code that runs (it may arrive as --py-files, without metadata)
            import sparkring

            return sparkring.__version__
        except Exception as exc:  # noqa: BLE001 - installed but broken: say how
            return f"broken ({type(exc).__name__}: {exc})"
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check_store(url: str, storage_options: Dict[str, Any]) -> str:
    """Write a small file into the Store at ``url``, read it back and remove it (fsspec, as the
    ranks' Store does); "" when that worked, else what went wrong."""
    import uuid

    try:
        import fsspec

        fs, root = fsspec.core.url_to_fs(url, **storage_options)
        fs.makedirs(root, exist_ok=True)  # as the Store does (nothing on an object store)
        path = f"{root.rstrip('/')}/.sparkring-doctor-{uuid.uuid4().hex}"
        fs.pipe_file(path, b"ok")
        try:
            if fs.cat_file(path) != b"ok":
                return f"{url}: what was written reads back differently"
        finally:
            fs.rm_file(path)
        return ""
    except Exception as exc:  # noqa: BLE001 - every filesystem raises its own type
        return f"{type(exc).__name__}: {exc}"


def probe(executor: str, gpus: List[str], driver_host: str, driver_port: int,
          timeout: float = 5.0, store: Optional[Tuple[str, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """Look around this task's executor (import torch where it is there: GPUs, NCCL); the
    fields of TaskFacts as a dict (a dataclass pickled by value loses its __init__ under the
    cloudpickle of Spark 3.5)."""
    versions = {"python": platform.python_version(), **{name: installed_version(name) for name in PACKAGES}}
    facts: Dict[str, Any] = {
        "executor": executor, "hostname": socket.gethostname(), "python_executable": sys.executable,
        "versions": versions, "cpu_count": os.cpu_count() or 1, "gpus_assigned": list(gpus), "gpus_visible": None,
        "nccl": False, "shm_free_bytes": None, "mpiexec": find_mpiexec(),
        "mpi4py": importlib.util.find_spec("mpi4py") is not None, "driver_reachable": False, "driver_error": "",
        "errors": []}
    if versions["torch"] != "missing":
        try:
            import torch

            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
            facts["gpus_visible"] = visible
            facts["nccl"] = bool(torch.distributed.is_available() and torch.distributed.is_nccl_available()
                                 and visible)
        except Exception as exc:  # noqa: BLE001 - a torch that does not import is a finding
            facts["errors"].append(f"import torch: {type(exc).__name__}: {exc}")
    if os.path.isdir("/dev/shm"):
        facts["shm_free_bytes"] = shutil.disk_usage("/dev/shm").free
    try:
        with socket.create_connection((driver_host, driver_port), timeout=timeout):
            facts["driver_reachable"] = True
    except OSError as exc:
        facts["driver_error"] = f"{driver_host}:{driver_port}: {exc}"
    if store is not None:
        facts["store_error"] = check_store(*store)
    return facts


def barrier_probe(driver_host: str, driver_port: int, store: Optional[Tuple[str, Dict[str, Any]]] = None):
    """The mapInArrow function of the doctor's barrier stage: one JSON row per task."""

    def run(batches):
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        for _ in batches:
            pass
        ctx = BarrierTaskContext.get()
        executor = ctx.getTaskInfos()[ctx.partitionId()].address
        resources = ctx.resources()
        gpus = list(resources["gpu"].addresses) if "gpu" in resources else []
        facts = probe(executor, gpus, driver_host, driver_port, store=store)
        yield pa.RecordBatch.from_pydict({"facts": [json.dumps(facts)]})

    return run


def interpreter_probe(names: Tuple[str, ...]):
    """The UDF of the launch's first look at an executor: the interpreter that runs it and the
    versions of ``names`` it imports, as JSON (plain Python: it needs neither pyarrow nor sparkring)."""

    def facts(_: Any) -> str:
        versions = {name: installed_version(name) for name in names}
        return json.dumps({"executable": sys.executable, "versions": versions})

    return facts
