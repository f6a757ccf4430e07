"""Entry point of a rank's worker process: run the pickled function inside the ring."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback

from ...collective import environment
from ...errors import type_name
from .workdir import WorkDir


def _die_with_parent() -> None:
    """Exit when the task process that owns this rank is gone (it is the parent of a forked
    worker, the grandparent under mpiexec)."""
    task = environment.RankEnv.from_env().parent_pid or 0
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the kernel kills us with our parent
    except OSError:
        pass

    def task_alive() -> bool:
        try:
            os.kill(task, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    if not task:
        return
    parent = os.getppid()

    def watch():
        while True:
            if os.getppid() != parent or not task_alive():
                os._exit(137)
            time.sleep(0.5)

    if not task_alive():
        os._exit(137)
    threading.Thread(target=watch, daemon=True).start()


def _report_error(tb: str, exc: BaseException, exit_code=None) -> None:
    from .. import channel, protocol

    try:
        from ..failures import is_secondary

        channel.report_raw(protocol.Error(rank=0, attempt=0, kind=protocol.EXCEPTION, traceback=tb,
                                          exit_code=exit_code, secondary=is_secondary(tb),
                                          exception_type=type_name(type(exc)), message=str(exc)))
    except Exception:  # noqa: BLE001 - the task still reports from error.txt
        pass


def _name_process() -> None:
    """Show up as sparkring-rank<N> in ps/top (a forked worker keeps its parent's cmdline)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(15, f"sparkring-r{os.environ.get(environment.RANK, '?')}".encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except OSError:
        pass


def _load_payload(path: str):
    import cloudpickle

    try:
        with open(path, "rb") as f:
            return cloudpickle.load(f)
    except ModuleNotFoundError as exc:  # cloudpickle pickles a module's functions by reference
        raise ModuleNotFoundError(
            f"{exc} on this executor: the function (or an argument) comes from module {exc.name!r}, which "
            "the driver imports but the executors cannot; ship it (spark.sparkContext.addPyFile, "
            "spark-submit --py-files) or install it on every executor", name=exc.name) from exc


def main(path: str) -> None:
    """A rank's worker process: run the payload in the work directory ``path``, write its result there."""
    workdir = WorkDir(path)
    _die_with_parent()
    _name_process()
    import faulthandler

    with open(workdir.pid, "w") as f:
        f.write(str(os.getpid()))
    stacks = open(workdir.stacks, "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    import cloudpickle

    from .. import channel

    if os.environ.get(environment.SECRET):
        channel.take_secret()  # before any user code runs (unpickling imports the user's modules)
    try:
        fn, args, kwargs = _load_payload(workdir.payload)
        import torch

        import sparkring.collective  # noqa: F401 - loaded before the user's code: its first call only joins the ring

        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit():
            torch.set_num_threads(int(threads))  # the env var alone is too late after a fork
        from ...collective import hosting

        hosting.before_user_code()
        # No sr.init() here: sparkring.collective joins the ring on first use, so code that
        # sets up torch.distributed itself (torchrun-style scripts) comes first.
        result = hosting.call_user_code(fn, args, kwargs)
        spans = hosting.timeline_events()
        if spans is not None:
            channel.report(spans)  # before the result: the driver has every rank's spans when results are in
        tmp = workdir.result + ".tmp"
        with open(tmp, "wb") as f:
            cloudpickle.dump(result, f)
        os.replace(tmp, workdir.result)
        hosting.after_user_code()
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the driver
        exit_code = getattr(exc, "exit_code", None)
        tb = traceback.format_exc()
        with open(workdir.raised, "w") as f:  # before error.txt, which says the rank failed
            json.dump({"type": type_name(type(exc)), "message": str(exc)}, f)
        with open(workdir.error, "w") as f:
            f.write(tb)
        _report_error(tb, exc, exit_code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code if isinstance(exit_code, int) and 0 < exit_code < 256 else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
