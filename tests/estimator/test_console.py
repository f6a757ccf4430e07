"""The driver's console during fit(), captured as a user sees it: in a terminal (a pseudo-
terminal) a bar that moves and one line per epoch, Spark's own stage bar held back during fit
and back afterwards; in a pipe (spark-submit logs, CI) no bar at all; never a warning."""
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
from paths import HELPERS, ROOT

SCRIPT = os.path.join(HELPERS, "console_fit.py")
pytestmark = pytest.mark.slow


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HELPERS, ROOT]), COLUMNS="120")
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    return env


def _in_terminal(store, timeout=240):
    """The script's stdout and stderr as one terminal shows them (raw bytes, \\r included)."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 120x40 terminal
    proc = subprocess.Popen([sys.executable, SCRIPT, store], stdin=child, stdout=child, stderr=child, env=_env(),
                            close_fds=True)
    os.close(child)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the terminal closed: the script ended
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        os.close(main)
    assert proc.returncode == 0, out.decode(errors="replace")[-4000:]
    return out.decode(errors="replace")


def _warnings(text):
    return [line for line in text.splitlines() if "Warning" in line and "WARN NativeCodeLoader" not in line]


@pytest.fixture(scope="module", autouse=True)
def in_a_pipe(tmp_path_factory):
    """The script in a pipe, started with the module so that it runs beside the terminal's run
    (both mostly wait: the model sleeps each step); the pipe's test collects it."""
    store = tmp_path_factory.mktemp("pipe") / "store"
    proc = subprocess.Popen([sys.executable, SCRIPT, str(store)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env())
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


def test_in_a_terminal_the_bar_moves_each_epoch_prints_one_line_and_spark_bar_waits_until_fit_ends(tmp_path):
    text = _in_terminal(str(tmp_path / "store"))
    fit, after = text.split("FIT-DONE", 1)
    epoch_lines = re.findall(r"^epoch (\d)/2  loss=\d", fit.replace("\r", "\n"), re.M)
    assert epoch_lines == ["1", "2"], fit[-3000:]
    for epoch in ("1/2", "2/2"):  # the bar was drawn at several steps of each epoch
        steps = {int(m) for m in re.findall(rf"epoch {epoch}:\s+\d+%\|[^|]*\|\s*(\d+)/40", fit)}
        assert len(steps) >= 2 and max(steps) > 1, (epoch, steps, fit[-3000:])
    assert "[Stage" not in fit and "Stage " not in fit.split("epoch 1/2", 1)[1], fit[-3000:]
    assert re.search(r"\[Stage \d+:", after.split("TRANSFORM-DONE", 1)[1]), after[-3000:]  # Spark's bar is back
    assert _warnings(text) == [], _warnings(text)


def test_in_a_pipe_there_is_no_bar_only_one_line_per_epoch(in_a_pipe):
    stdout, stderr = in_a_pipe.communicate(timeout=240)
    assert in_a_pipe.returncode == 0, stderr[-4000:]
    fit = stdout.split("FIT-DONE", 1)[0]
    assert re.findall(r"^epoch (\d)/2  loss=\d", fit, re.M) == ["1", "2"]
    assert fit.strip().splitlines() == [line for line in fit.strip().splitlines() if line.startswith("epoch ")]
    assert "%|" not in stderr and "\r" not in stdout
    assert _warnings(stdout + stderr) == [], _warnings(stdout + stderr)
