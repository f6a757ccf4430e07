"""sparkring.run on real Spark barrier stages: results, failures, timeouts, logs, GPUs."""
import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types

import psutil
import pytest
import rank_fns
import torch
from leftovers import ctrl_c_when_ranks_run, wait_no_workers
from paths import HELPERS, ROOT
from waiting import wait_until

from sparkring import ConfigurationError, HostLostError, RankFailedError, RankTimeoutError, SparkRingError, run
from sparkring.runner import channel, plan, protocol
from sparkring.runner.protocol import ConnectionClosed, Log


@pytest.mark.compat
def test_run_returns_results_ordered_by_rank_with_ranks_layout(spark):
    results = run(rank_fns.whoami, num_proc=2)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["local_size"] == 2 for r in results)
    assert [r["local_rank"] for r in results] == [0, 1]
    assert results[0]["pid"] != results[1]["pid"] != os.getpid()
    from sparkring.runner.driver.launch import last_worker_pids

    assert sorted(last_worker_pids()) == sorted(r["pid"] for r in results)
    assert results[0]["cuda"] == ""  # no GPU asked: no GPU visible
    assert wait_no_workers() == []


def test_fifty_megabyte_results_come_back_whole(spark):
    results = run(rank_fns.big_result, args=(50,), num_proc=2)
    for rank, res in enumerate(results):
        g = torch.Generator().manual_seed(rank)
        assert torch.equal(res["w"], torch.randn(50 * 1024 * 1024 // 4, generator=g))


@pytest.mark.compat
def test_a_rank_measures_its_link_to_the_driver_and_its_channel_goes_on_carrying_events(spark):
    events = []
    results = run(rank_fns.measured_link_then_report, args=(4 << 20,), num_proc=2,
                  on_event=lambda rank, payload: events.append((rank, payload)))
    # 4 MB timed until the driver said they arrived: loopback moves far more than 10 MB/s, and less than 100 GB/s
    assert all(10e6 < r["rate"] < 100e9 and r["reported"] for r in results), results
    assert sorted(events) == [(0, {"after_probe": True}), (1, {"after_probe": True})]
    assert channel.measure_link(1024) is None  # outside a run: no driver to measure against


def test_exception_in_one_rank_reaches_driver_with_rank_and_traceback_and_stops_the_others(spark):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run(rank_fns.fail_on_rank, args=(1,), num_proc=2)
    elapsed = time.monotonic() - started
    assert info.value.rank == 1
    assert "ValueError: boom on purpose in rank 1" in info.value.remote_traceback
    assert "fail_on_rank" in info.value.remote_traceback
    assert elapsed < 30, f"failure took {elapsed:.1f}s to reach the driver"
    assert wait_no_workers() == []
    # the session is still usable after a failed run
    assert [r["rank"] for r in run(rank_fns.whoami, num_proc=2)] == [0, 1]


def test_a_function_whose_module_only_the_driver_has_fails_naming_the_module_and_the_fix(spark, tmp_path,
                                                                                          monkeypatch):
    (tmp_path / "only_on_the_driver.py").write_text("def train():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    only_on_the_driver = importlib.import_module("only_on_the_driver")
    with pytest.raises(RankFailedError) as info:
        run(only_on_the_driver.train, num_proc=2, verbose=0)
    assert "No module named 'only_on_the_driver'" in info.value.remote_traceback
    assert "addPyFile" in info.value.remote_traceback and "--py-files" in info.value.remote_traceback


def test_rank_exceeding_timeout_fails_the_run_naming_the_rank(spark):
    started = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"exceeded timeout=4s") as info:
        run(rank_fns.hang_on_rank, args=(1,), num_proc=2, timeout=4)
    assert time.monotonic() - started < 40
    assert info.value.ranks
    # every rank's stack says where it was: rank 1 asleep in hang_on_rank, rank 0 in the barrier
    text = str(info.value)
    rank1 = text[text.index("rank 1 "):]
    rank1 = rank1[:rank1.index("rank 0 ")] if "rank 0 " in rank1 else rank1
    assert "in hang_on_rank" in rank1
    assert wait_no_workers() == []


def test_logs_stream_live_to_the_driver_while_ranks_run(spark, tmp_path, capsys):
    flag = tmp_path / "seen"
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", run(rank_fns.print_and_wait, args=(str(flag),),
                                                                 num_proc=2)))
    t.start()
    out = []

    def waiting_for_the_driver() -> bool:
        out.append(capsys.readouterr().out)
        return "waiting-for-driver" in "".join(out)

    wait_until(waiting_for_the_driver, timeout=60, every=0.1)
    flag.touch()
    t.join(60)
    seen = "".join(out)
    assert "waiting-for-driver" in seen
    assert box["r"] == [True, True], "rank 0 never saw the driver react: logs were not live"
    assert "rank 0 says hello" in seen and "rank 1 says hello" not in seen  # verbose=1: rank 0 only


def test_verbose_two_prefixes_every_rank_and_zero_is_silent(spark, tmp_path, capsys):
    (tmp_path / "seen").touch()
    run(rank_fns.print_and_wait, args=(str(tmp_path / "seen"),), num_proc=2, verbose=2)
    out = capsys.readouterr().out
    assert "[0] rank 0 says hello" in out and "[1] rank 1 says hello" in out
    run(rank_fns.print_and_wait, args=(str(tmp_path / "seen"),), num_proc=2, verbose=0)
    assert "says hello" not in capsys.readouterr().out


def test_events_reported_by_ranks_reach_on_event(spark):
    got = []
    run(rank_fns.report_events, args=(5,), num_proc=2, on_event=lambda rank, p: got.append((rank, p["i"])))
    assert sorted(got) == sorted([(r, i) for r in (0, 1) for i in range(5)])


def test_local_mode_ranks_see_the_host_gpus_ordered_by_local_rank_and_start_in_a_fresh_interpreter(spark):
    results = run(rank_fns.gpu_view, num_proc=2, use_gpu=True)
    # every rank of the host sees the same list, so torch.cuda.set_device(local_rank) picks its own GPU
    assert [r["cuda"] for r in results] == ["0,1", "0,1"]
    assert [r["gpu"] for r in results] == ["0", "1"]
    assert all(r["spawned"] for r in results)  # the reused Spark worker may have touched CUDA: no fork
    assert all(r["backend"] == "gloo" for r in results)  # this torch has no NCCL: the driver chose gloo
    cpus = run(rank_fns.gpu_view, num_proc=2, use_gpu=False)
    # (CPU ranks fork, unless the reused worker runs other threads: test_gpus checks that rule)
    assert all(r["cuda"] == "" and r["gpu"] is None for r in cpus)


def _fake_session(master, **conf):
    """A classic-looking session that only answers spark.conf.get (what plan() reads)."""
    conf = dict(conf, **{"spark.master": master})
    return types.SimpleNamespace(conf=types.SimpleNamespace(get=lambda k, d=None: conf.get(k, d)),
                                 sparkContext=types.SimpleNamespace(resources={}, defaultParallelism=0))


def test_dynamic_allocation_plans_an_ordinary_stage_and_refuses_what_its_bound_cannot_run():
    autoscaling = {"spark.dynamicAllocation.enabled": "true", "spark.dynamicAllocation.maxExecutors": "2",
                   "spark.executor.cores": "1"}
    session = _fake_session("spark://127.0.0.1:7077", **autoscaling)
    planned = plan(session, 2, use_gpu=False)
    assert planned.gang and planned.attempts == 1  # a lost task is a lost rank: Spark never reruns it alone
    with pytest.raises(ConfigurationError, match=r"num_proc=3 needs 3 tasks at once, more than dynamic allocation "
                                                 r"can give \(spark.dynamicAllocation.maxExecutors=2"):
        plan(session, 3, use_gpu=False)
    assert plan(session, 3, use_gpu=False, min_proc=2).num_proc == 3  # elastic: it may start with 2
    with pytest.raises(ConfigurationError, match="keep the live channel on"):
        plan(session, 2, use_gpu=False, stream=False)


def test_unscheduled_gpus_are_refused_with_the_fix():
    with pytest.raises(ConfigurationError, match="spark.task.resource.gpu.amount is not set"):
        plan(_fake_session("local-cluster[2,1,1024]"), 2, use_gpu=True)
    assert plan(_fake_session("local[4,3]")).num_proc == 4
    assert plan(_fake_session("local[4,3]")).attempts == 4  # spark.stage.maxConsecutiveAttempts (default 4)
    assert plan(_fake_session("local-cluster[3,2,512]", **{"spark.task.cpus": "2"})).num_proc == 3


@pytest.mark.parametrize("setting", ["spark.ssl.enabled", "spark.network.crypto.enabled", "spark.authenticate"])
def test_secured_clusters_are_refused_unless_the_user_accepts_plain_rank_traffic(setting):
    with pytest.raises(ConfigurationError, match=rf"{setting}=true: .* Set spark.sparkring.ignoreSsl=true"):
        plan(_fake_session("local[2]", **{setting: "true"}), 2)
    accepted = plan(_fake_session("local[2]", **{setting: "true", "spark.sparkring.ignoreSsl": "true"}), 2)
    assert accepted.num_proc == 2 and accepted.facts.secured_by == (setting,)


SECURED_RUN = """
import sys, sparkring
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[1]").config("spark.driver.host", "127.0.0.1")
         .config("spark.authenticate", "true").getOrCreate())
try:
    sparkring.run(lambda: 1, num_proc=1)
except sparkring.ConfigurationError as exc:
    print("refused:", exc)
spark.conf.set("spark.sparkring.ignoreSsl", "true")
print("result:", sparkring.run(lambda: 41 + 1, num_proc=1, verbose=0))
spark.stop()
"""


@pytest.mark.slow  # a Spark session in a subprocess
def test_a_session_with_spark_authenticate_refuses_then_runs_after_the_opt_in():
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, "-c", SECURED_RUN], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: spark.authenticate=true: this cluster secures Spark's own traffic" in proc.stdout
    assert "result: [42]" in proc.stdout


def _log(line):
    return Log(rank=0, attempt=0, stream="stdout", line=line)


def _messages_into(got):
    """A channel handler keeping what peers sent (not the channel's own word that one left)."""
    return lambda frame, conn: got.append(frame) if not isinstance(frame, ConnectionClosed) else None


def test_channel_binds_the_given_address_and_drops_unsigned_frames():
    got = []
    server = channel.DriverChannel("127.0.0.1", b"k" * 32, _messages_into(got))
    try:
        assert server.address[0] == "127.0.0.1"
        with pytest.raises(ValueError):
            channel.DriverChannel("0.0.0.0", b"k" * 32, lambda m, c: None)
        bad = channel.connect(*server.address, secret=b"x" * 32)
        bad.send(_log("forged"))
        good = channel.connect(*server.address, secret=b"k" * 32)
        good.send(_log("real"))
        wait_until(lambda: got and server.rejected >= 1, timeout=5)
        assert got == [_log("real")]
        assert server.rejected == 1
        bad.close()
        good.close()
    finally:
        server.close()


def test_channel_refuses_replayed_reflected_and_forged_frames():
    import socket as socket_module

    got = []
    secret = b"k" * 32
    server = channel.DriverChannel("127.0.0.1", secret, _messages_into(got))
    try:
        good = channel.connect(*server.address, secret=secret)
        assert good.send(_log("first"))
        # what an eavesdropper captured: the same bytes the client just sent (frame 0 of that connection)
        captured = channel.encode_frame(secret, channel.frame_context(good._nonce, channel.CLIENT, 0),
                                        _log("first"))
        replay = socket_module.create_connection(server.address)
        replay.recv(channel.NONCE_LEN)
        replay.sendall(captured)  # on a new connection: another nonce
        again = channel.connect(*server.address, secret=secret)
        again.sock.sendall(captured)  # a frame 0 from another connection, on this one's frame 0
        assert good.send(_log("second"))
        wait_until(lambda: len(got) >= 2 and server.rejected >= 2, timeout=5)
        assert got == [_log("first"), _log("second")]
        assert server.rejected == 2
        good.sock.sendall(captured)  # the same frame twice on its own connection: out of place
        wait_until(lambda: server.rejected >= 3, timeout=5)
        assert server.rejected == 3 and len(got) == 2
        for conn in (good, again):
            conn.close()
        replay.close()
    finally:
        server.close()


def _cli_env():
    env = dict(os.environ)
    env.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    return env


def test_cli_runs_a_script_on_every_rank_and_returns_its_exit_status(spark, capsys):
    # in-process, on the session at hand (what the CLI does under spark-submit); real command
    # lines run in test_spark_submit_runs_the_cli_entry_point and tests/integration/test_standalone.py
    from sparkring.__main__ import main

    script = os.path.join(ROOT, "examples", "hello_ring.py")
    assert main(["run", "-np", "2", script, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "step 1 loss" in out and "weights identical on all ranks: True" in out
    assert out.count("step 1 loss") == 1  # rank 0's output only
    assert main(["run", "-np", "2", script, "--steps", "1", "--exit-code", "3"]) == 3
    assert "sparkring: rank" in capsys.readouterr().err


@pytest.mark.compat
def test_cluster_gpus_come_from_task_resources_and_ranks_span_executors(spark_cluster):
    results = run(rank_fns.whoami, num_proc=2)  # GPUs are scheduled in this session
    assert [r["rank"] for r in results] == [0, 1]
    # both executors of local-cluster run on this host and each discovered GPU "0": shared
    assert all(r["cuda"] == "0" for r in results)
    assert all(r["omp"] == "1" for r in results)
    assert wait_no_workers() == []


def test_nccl_is_refused_when_two_ranks_of_a_host_were_given_the_same_gpu(spark_cluster):
    with pytest.raises(RankFailedError, match=r"backend='nccl' but ranks on host\(s\) \['127.0.0.1'\] share a GPU "
                                              r"\(they were given the same GPU\), which NCCL refuses"):
        run(rank_fns.whoami, num_proc=2, backend="nccl")
    assert wait_no_workers() == []


@pytest.mark.slow
def test_spark_submit_runs_the_cli_entry_point():
    import pyspark

    submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    main = os.path.join(ROOT, "sparkring", "__main__.py")
    script = os.path.join(ROOT, "examples", "hello_ring.py")
    env = _cli_env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([submit, "--master", "local[2]", "--conf", "spark.driver.host=127.0.0.1", main,
                           "run", "-np", "2", script, "--steps", "2"], capture_output=True, text=True,
                          env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "weights identical on all ranks: True" in proc.stdout


def test_the_run_secret_is_not_left_for_user_code_and_its_children(spark):
    events = []
    results = run(rank_fns.secret_visibility, num_proc=2, on_event=lambda rank, e: events.append(rank))
    assert results == [{"in_rank": False, "in_child": False, "reported": True}] * 2
    assert sorted(events) == [0, 1]


def test_runs_leave_no_channel_threads_behind_in_the_driver(spark):
    def channel_threads():
        return [t for t in threading.enumerate() if t.name == "sparkring-channel"]

    for _ in range(3):
        assert run(rank_fns.whoami, num_proc=2)
    assert channel_threads() == []


def test_a_rank_killed_by_sigkill_is_named_with_its_signal_and_usual_cause(spark):
    started = time.monotonic()
    with pytest.raises(RankFailedError, match=r"(?s)rank 1's worker process was killed by signal 9 \(SIGKILL\).*"
                                              r"out-of-memory killer") as info:
        run(rank_fns.killed_on_rank, args=(1,), num_proc=2)
    assert info.value.rank == 1
    assert time.monotonic() - started < 30


def test_cancelling_the_spark_jobs_from_another_thread_stops_the_run_and_its_ranks(spark):
    timer = threading.Timer(4.0, spark.sparkContext.cancelAllJobs)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(SparkRingError, match="the Spark job of this run was cancelled"):
            run(rank_fns.hang_on_rank, args=(0,), num_proc=2)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 40
    assert wait_no_workers(10) == []
    assert run(rank_fns.whoami, num_proc=2)  # the session still runs the next one


def test_ctrl_c_during_run_stops_its_ranks_and_the_next_run_works(spark):
    ctrl_c_when_ranks_run(2)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run(rank_fns.hang_on_rank, args=(0,), num_proc=2, verbose=0)
    assert time.monotonic() - started < 60
    assert wait_no_workers(10) == []
    assert [r["rank"] for r in run(rank_fns.whoami, num_proc=2, verbose=0)] == [0, 1]


LOST_FOR_GOOD = """
import os, sys, threading, time
import psutil
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local-cluster[2,1,1024]").config("spark.driver.host", "127.0.0.1")
         .config("spark.executor.memory", "512m").config("spark.ui.enabled", "false")
         .config("spark.deploy.maxExecutorRetries", "1000")
         .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"]).getOrCreate())
import rank_fns, sparkring
marker = sys.argv[1]

def executors():
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in p.cmdline():
                found.append(p)
        except psutil.Error:  # gone, or a zombie of a killed one
            pass
    return found

while len(executors()) < 2:
    time.sleep(0.2)
first = {p.pid for p in executors()}

def node_stays_down():
    # once rank 0 killed its executor, every executor started after it dies at once: the node is gone
    while not os.path.exists(marker):
        time.sleep(0.2)
    survivors = first
    end = time.time() + 90
    while time.time() < end:
        for p in executors():
            if p.pid not in survivors:
                p.kill()
        time.sleep(0.2)

threading.Thread(target=node_stays_down, daemon=True).start()
started = time.monotonic()
try:
    sparkring.run(rank_fns.lose_executor_of_rank0, args=(marker,), num_proc=2, start_timeout=12, verbose=0)
except sparkring.RankTimeoutError as exc:
    print(f"after {time.monotonic() - started:.0f}s:", str(exc).splitlines()[0])
spark.stop()
"""


@pytest.mark.slow  # a Spark session in a subprocess
def test_a_lost_executor_that_never_comes_back_ends_the_run_with_the_missing_slots_named(tmp_path):
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([HELPERS, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", LOST_FOR_GOOD, str(tmp_path / "lost")], capture_output=True,
                          text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    # attempt 2 where a replacement executor lived long enough for Spark to start the stage again
    assert re.search(r"after \d+s: attempt [12] of the barrier stage failed \(.*\) and Spark did not start the 2 ranks "
                     r"again within start_timeout=12s: the cluster lacks 2 free task slots", line), proc.stdout
    assert int(line.split()[1].rstrip("s:")) < 90
    assert wait_no_workers(30) == []


@pytest.mark.slow  # a Spark session in a subprocess
def test_ranks_exit_when_the_driver_process_dies(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(
        "import os, sys, time\n"
        "from pyspark.sql import SparkSession\n"
        "spark = SparkSession.builder.master('local[2]').config('spark.driver.host', '127.0.0.1')"
        ".config('spark.ui.enabled', 'false').getOrCreate()\n"
        "import rank_fns\n"
        "from sparkring import run\n"
        "run(rank_fns.hang_on_rank, args=(0,), num_proc=2, verbose=0)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HELPERS, os.environ.get("PYTHONPATH", "")]))
    driver = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        ranks = []

        def both_ranks_started() -> bool:
            ranks[:] = [p for p in psutil.process_iter(["name"])
                        if (p.info.get("name") or "").startswith("sparkring-r")]
            return len(ranks) >= 2

        wait_until(both_ranks_started, timeout=90, every=0.5)
        assert len(ranks) == 2, "the ranks never started"
        driver.kill()  # the driver's Python process only: its JVM and the tasks must notice
        gone = time.monotonic()
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert alive == [], f"ranks still alive {time.monotonic() - gone:.0f} s after the driver died"
    finally:
        try:
            os.killpg(driver.pid, 9)
        except ProcessLookupError:
            pass


def test_executors_whose_versions_differ_from_the_driver_fail_before_any_rank_starts(spark, monkeypatch):
    launch_module = importlib.import_module("sparkring.runner.driver.launch")  # the package's `launch` is the function
    real = launch_module.package_versions()
    # the driver claims other versions: the (real) executors must see the skew and say so
    monkeypatch.setattr(launch_module, "package_versions", lambda: dict(real, torch="2.12.0", python="3.10.4"))
    with pytest.raises(RankFailedError, match="the executors run other versions than the driver") as info:
        run(rank_fns.whoami, num_proc=2)
    text = str(info.value)
    assert f"torch {real['torch']} (driver 2.12.0)" in text and f"python {real['python']} (driver 3.10.4)" in text
    assert "spark.archives" in text and "cloudpickle" not in text  # only what differs
    assert wait_no_workers() == []
    monkeypatch.undo()
    assert len(run(rank_fns.whoami, num_proc=2)) == 2  # same versions: runs


def test_a_rank_busy_holding_its_interpreter_is_not_taken_for_a_lost_host(spark):
    # the beats come from the task's process, not the rank's: a busy rank still beats
    assert run(rank_fns.busy_without_a_word, args=(6.0,), num_proc=2, heartbeat_timeout=1.5) == [True, True]


def test_a_task_that_falls_silent_ends_the_run_within_the_heartbeat_timeout_naming_its_rank_and_host(spark, tmp_path):
    # a frozen task process stands in for a host cut off the network (tests/integration/test_hosts.py cuts real links)
    marker = str(tmp_path / "task-pid")
    frozen = []

    def freeze_rank_ones_task():
        wait_until(lambda: os.path.exists(marker), timeout=60, every=0.05)
        frozen.append(int(open(marker).read()))
        os.kill(frozen[0], signal.SIGSTOP)
        frozen.append(time.monotonic())

    freezer = threading.Thread(target=freeze_rank_ones_task, daemon=True)
    freezer.start()
    try:
        with pytest.raises(HostLostError, match=r"rank 1 on host \S+: no word from its task for "
                                                r"heartbeat_timeout=3s") as info:
            run(rank_fns.tell_my_task_then_wait_in_allreduce, args=(marker, 1), num_proc=2, timeout=300,
                heartbeat_timeout=3)
        silent_for = time.monotonic() - frozen[1]
    finally:
        freezer.join(60)
        if frozen:
            os.kill(frozen[0], signal.SIGCONT)
    # silence counts from the task's last beat, which may come up to one beat (0.5 s at 3 s) before the
    # freeze: the timeout less that beat at the earliest; at the latest plus the watch's rounds
    assert 3 - protocol.beat_interval(3) <= silent_for < 3 + 10
    assert list(info.value.lost) == [1] and list(info.value.hosts) == [1]
    assert wait_no_workers(timeout=60) == []
