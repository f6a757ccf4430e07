"""Command line: ``python -m sparkring run -np 2 train.py [args]`` (the horovodrun habit) and
``python -m sparkring doctor`` (check a cluster before training)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparkring",
                                description="Run a training script on every rank of a Spark barrier stage.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run SCRIPT on -np ranks")
    r.add_argument("-np", "--num-proc", type=int, default=None, help="number of ranks (default: all task slots)")
    hosts = r.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", default=None,
                       help="horovodrun's host list, host:slots,... (one host: that many local ranks; several: "
                            "executors on those hosts, --master)")
    hosts.add_argument("--hostfile", default=None, help="horovodrun's hostfile: 'host slots=N' per line")
    r.add_argument("--master", default=None, help="Spark master when no session exists (default: local[NP])")
    r.add_argument("--remote", default=None,
                   help="Spark Connect URL, e.g. sc://host:15002 (default: $SPARK_REMOTE when set)")
    r.add_argument("--no-stream", dest="stream", action="store_false",
                   help="no live output: logs arrive when the ranks end (for executors that cannot reach "
                        "this machine)")
    r.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"])
    r.add_argument("--use-gpu", action="store_true", default=None, help="schedule one GPU per rank")
    r.add_argument("--timeout", type=float, default=None, help="seconds before a rank is killed")
    r.add_argument("--start-timeout", type=float, default=120.0)
    r.add_argument("--heartbeat-timeout", type=float, default=30.0,
                   help="seconds a running rank's host may stay silent before the run names it lost (0: never)")
    r.add_argument("-v", "--verbose", type=int, default=1, help="0: quiet, 1: rank 0 output, 2: every rank")
    r.add_argument("--min-np", type=int, default=None,
                   help="elastic: go on with at least this many ranks when some are lost (hvd.elastic in the script)")
    r.add_argument("--ranks-per-task", type=int, default=None,
                   help="ranks each Spark task runs (default: one per GPU of a task holding several, else 1)")
    r.add_argument("--max-restarts", type=int, default=3, help="elastic: launches after a loss, at most")
    r.add_argument("--elastic-dir", default=None,
                   help="elastic: where rank 0 persists commits (every executor reaches it; default: a temporary "
                        "directory, where every task runs on this machine)")
    r.add_argument("script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)
    d = sub.add_parser("doctor", help="check the cluster: versions, slots, GPUs, /dev/shm, MPI, the driver's "
                                      "address; exits 1 when a fit would break")
    d.add_argument("-np", "--num-proc", type=int, default=None, help="barrier tasks (default: all task slots)")
    d.add_argument("--master", default=None, help="Spark master when no session exists (default: local[*])")
    d.add_argument("--remote", default=None, help="Spark Connect URL (default: $SPARK_REMOTE when set)")
    d.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the barrier stage")
    d.add_argument("--store", default=None, help="a Store URL or path every executor must write to (s3:// takes "
                                                 "the usual AWS environment variables)")
    return p


def _doctor(args) -> int:
    from sparkring.runner.driver.doctor import doctor

    spark, owned = _session(args.master, args.num_proc, args.remote, this_interpreter=False)
    try:
        report = doctor(spark, num_tasks=args.num_proc, timeout=args.timeout, store=args.store)
        print(report)
        return 0 if report.ok else 1
    finally:
        if owned:
            spark.stop()


def _session(master: Optional[str], num_proc: Optional[int], remote: Optional[str] = None, *,
             this_interpreter: bool = True):
    """The active session, else a new one (``this_interpreter``: its executors run this Python unless
    PYSPARK_PYTHON says otherwise; the doctor looks at what a user's own session would run)."""
    from pyspark.sql import SparkSession

    remote = remote or os.environ.get("SPARK_REMOTE")
    if remote:
        if master:
            raise SystemExit("sparkring: give --master or --remote (Spark Connect), not both")
        return SparkSession.builder.remote(remote).getOrCreate(), True
    spark = SparkSession.getActiveSession()
    if spark is not None:
        return spark, False
    from pyspark import SparkContext

    if SparkContext._active_spark_context is not None:  # spark-submit gave us a context
        return SparkSession(SparkContext._active_spark_context), False
    if this_interpreter:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName("sparkring run")
    if master or "spark.master" not in os.environ.get("PYSPARK_SUBMIT_ARGS", ""):
        builder = builder.master(master or f"local[{num_proc or '*'}]")
    if os.environ.get("SPARK_LOCAL_IP"):
        builder = builder.config("spark.driver.host", os.environ["SPARK_LOCAL_IP"])
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    return builder.getOrCreate(), True


INTERPRETERS = ("python", "python3")


def _without_interpreter(script: str, script_args: List[str]) -> tuple:
    """``horovodrun ... python train.py``'s leading interpreter word dropped: the ranks run the
    script with this interpreter (PYSPARK_PYTHON's) anyway.

    >>> _without_interpreter("python", ["train.py", "--lr", "0.1"])
    ('train.py', ['--lr', '0.1'])
    """
    words = set(INTERPRETERS) | {os.path.basename(sys.executable)}
    if (os.path.basename(script) in words or script == sys.executable) and script_args:
        return script_args[0], list(script_args[1:])
    return script, list(script_args)


def _host_list(args):
    from sparkring.runner.driver.horovod_launch import parse_hosts, read_hostfile

    if args.hosts:
        return parse_hosts(args.hosts)
    return read_hostfile(args.hostfile) if args.hostfile else None


def main(argv: Optional[List[str]] = None) -> int:
    """The ``sparkring`` command line (``run`` a script or function on ranks, ``doctor``); its exit status."""
    args = _parser().parse_args(argv)
    if args.command == "doctor":
        return _doctor(args)
    from sparkring.errors import StageLostError
    from sparkring.runner import ConfigurationError, RankFailedError, RankTimeoutError, launch, plan
    from sparkring.runner.driver.horovod_launch import ranks_from_hosts
    from sparkring.runner.driver.launch import launch_elastic
    from sparkring.runner.driver.plan import CLI_NAMES, check_timeouts
    from sparkring.runner.driver.script import ScriptMain
    from sparkring.runner.driver.session import session_facts

    try:  # mistakes in the command line fail before a Spark session starts
        heartbeat = args.heartbeat_timeout or None
        check_timeouts(args.timeout, args.start_timeout, CLI_NAMES, heartbeat)
        script_path, script_args = _without_interpreter(args.script, args.script_args)
        script = ScriptMain(script_path, script_args)
        host_list = _host_list(args)
    except ConfigurationError as e:
        print(f"sparkring: {e}", file=sys.stderr)
        return 2
    if host_list is not None and args.num_proc is None:
        args.num_proc = sum(h.slots for h in host_list)
    spark, owned = _session(args.master, args.num_proc, args.remote)
    try:
        if host_list is not None:
            facts = session_facts(spark)
            args.num_proc = ranks_from_hosts(host_list, args.num_proc, facts.single_host, facts.slots)
        launch_plan = plan(spark, num_proc=args.num_proc, use_gpu=args.use_gpu, backend=args.backend,
                           stream=args.stream, names=CLI_NAMES, registration_wait=args.start_timeout,
                           ranks_per_task=args.ranks_per_task, min_proc=args.min_np)
        if args.min_np is None:
            launch(spark, launch_plan, script, start_timeout=args.start_timeout, timeout=args.timeout,
                   verbose=args.verbose, heartbeat_timeout=heartbeat, names=CLI_NAMES)
        else:
            launch_elastic(spark, launch_plan, script, min_proc=args.min_np, max_restarts=args.max_restarts,
                           elastic_dir=args.elastic_dir, start_timeout=args.start_timeout, timeout=args.timeout,
                           verbose=args.verbose, names=CLI_NAMES, heartbeat_timeout=heartbeat)
        return 0
    except RankFailedError as e:
        print(f"sparkring: {e}", file=sys.stderr)
        return e.exit_code if isinstance(e.exit_code, int) and e.exit_code > 0 else 1
    except StageLostError as e:  # a lost executor or host: the run may succeed when started again
        print(f"sparkring: {e}", file=sys.stderr)
        return 1
    except (RankTimeoutError, ConfigurationError, FileNotFoundError) as e:
        print(f"sparkring: {e}", file=sys.stderr)
        return 2
    finally:
        if owned:
            spark.stop()


if __name__ == "__main__":
    sys.exit(main())
