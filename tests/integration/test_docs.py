"""The README and the guides as a user reads them: every Python block runs as written, in order per
page in one namespace (a page's later blocks go on from its first), in an empty directory; a block
whose first line is a ``# fragment`` comment says so to the reader and is not run. Written by hand
(tests/helpers/doc_pages.py): a page's blocks share one namespace, and every page one Spark
session started in that directory, which pytest-markdown-docs would run apart."""
import glob
import os
import re
import subprocess
import sys

import pytest
from doc_pages import FRAGMENT, python_blocks
from paths import ROOT

PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# pages whose Python needs what a laptop lacks; each runs elsewhere in the suite
NOT_RUNNABLE_HERE = {
    "docs/connect.md": "a Spark Connect server (tests/integration/test_connect.py starts one)",
    "docs/horovod.md": "Horovod itself, beside sparkring (its own test_torch.py runs in ../shared/conformance)",
}
HELPER = os.path.join(ROOT, "tests", "helpers", "doc_pages.py")


def _blocks(page):
    return python_blocks(os.path.join(ROOT, page))


def _runnable(page):
    return [(line, code) for line, code in _blocks(page) if not code.lstrip().startswith(FRAGMENT)]


def test_every_page_with_python_opens_with_a_runnable_example_unless_it_needs_a_cluster():
    for page in PAGES:
        blocks = _blocks(page)
        if not blocks or page in NOT_RUNNABLE_HERE:
            continue
        assert not blocks[0][1].lstrip().startswith(FRAGMENT), f"{page}: the first example is a fragment"
    for page in NOT_RUNNABLE_HERE:
        assert _blocks(page) and not _runnable(page), page


@pytest.mark.slow
def test_every_runnable_python_block_of_the_readme_and_the_guides_runs_as_written(tmp_path):
    pages = [p for p in PAGES if _runnable(p)]
    assert len(pages) >= 8, pages
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
    done = subprocess.run([sys.executable, HELPER, ROOT, *pages], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    report = [ln for ln in done.stdout.splitlines() if ln.endswith(": ok") or ": failed: " in ln]
    assert done.returncode == 0 and len(report) == len(pages), "\n".join(report) + "\n" + done.stderr[-6000:]
    assert "Traceback" not in done.stderr, done.stderr[-6000:]


def _as_a_newcomer(tmp_path):
    """The environment of a shell where the project's venv is not activated: PYSPARK_PYTHON unset
    and ``python3`` on PATH an interpreter without sparkring (a bare venv of the same Python)."""
    bare = tmp_path / "bare-python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True,
                   env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
    venv_bin = os.path.dirname(sys.executable)
    path = [str(bare / "bin")] + [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV")}
    return dict(env, PATH=os.pathsep.join(path), SPARK_LOCAL_IP="127.0.0.1"), str(bare / "bin" / "python3")


@pytest.mark.slow
def test_the_quickstart_trains_as_written_and_without_its_pyspark_python_line_says_the_fix_as_doctor_does(tmp_path):
    env, bare = _as_a_newcomer(tmp_path)
    [(_, quickstart)] = _blocks("README.md")[:1]
    work = tmp_path / "work"
    work.mkdir()
    (work / "quickstart.py").write_text(quickstart)
    done = subprocess.run([sys.executable, "quickstart.py"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert re.search(r"validation accuracy after 5 epochs: 0\.[89]\d\d", done.stdout), done.stdout
    assert "epoch 5/5" in done.stdout and "Traceback" not in done.stderr, done.stderr[-4000:]
    assert sorted(p.name for p in work.iterdir()) == ["points-model", "points.parquet", "quickstart.py", "runs"]

    line = 'os.environ.setdefault("PYSPARK_PYTHON", sys.executable)'
    assert line in quickstart
    (work / "quickstart.py").write_text(quickstart.replace(line, ""))
    failed = subprocess.run([sys.executable, "quickstart.py"], cwd=work, env=env, capture_output=True, text=True,
                            timeout=240)
    last = failed.stderr.strip().splitlines()[-1]
    assert failed.returncode == 1 and last.startswith("sparkring.errors.ConfigurationError: "), failed.stderr[-3000:]
    assert f"the executors' Python, {bare}, cannot import sparkring: set PYSPARK_PYTHON={sys.executable}" in last
    assert "epoch 1/5" not in failed.stdout  # it stopped before any rank started

    doctor = subprocess.run([sys.executable, "-m", "sparkring", "doctor"], cwd=work, env=env, capture_output=True,
                            text=True, timeout=240)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr[-3000:]
    [problem] = [ln for ln in doctor.stdout.splitlines() if ln.startswith("PROBLEM")]
    assert f"{bare}, cannot import sparkring. Fix: set PYSPARK_PYTHON={sys.executable}" in problem
