"""A Spark Connect server in a process of its own, bound to 127.0.0.1, for tests and benchmarks."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ConnectServer:
    """A Spark Connect server process on 127.0.0.1 (started on first use, killed at the end)."""

    def __init__(self, log_dir: str, master: str = "local[2]", confs: "dict | None" = None):
        import pyspark

        self.port = _free_port()
        self.log_path = os.path.join(log_dir, "connect-server.log")
        submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
        env = dict(os.environ, SPARK_CONNECT_MODE="0")
        env.pop("SPARK_CONNECT_MODE_ENABLED", None)
        env.pop("SPARK_REMOTE", None)
        confs = {
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(self.port),
            "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
            "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4",
            "spark.python.worker.reuse": "true",
            **(confs or {}),
        }
        command = [submit, "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
                   "--master", master, "--name", "sparkring-connect"]
        for key, value in confs.items():
            command += ["--conf", f"{key}={value}"]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Spark Connect server exited; see {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the Spark Connect server did not listen within 120 s; see {self.log_path}")

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()
