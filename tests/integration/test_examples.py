"""The example scripts, run as a user runs them (python examples/X.py, offline, own Spark
session), each against the goal it prints."""
import os
import re
import subprocess
import sys

import pytest
from paths import ROOT


@pytest.mark.parametrize("script,args,goal", [
    ("recommender.py", ["--fast"], r"held-out AUC: model (0\.\d+), popularity baseline (0\.\d+)"),
    ("images.py", ["--fast"], r"PNG bytes decoded in transformFn: 0\.9[5-9]"),
    ("lightning_digits.py", ["--epochs", "7"], r"held-out accuracy: (0\.9[5-9]|1\.0)"),
    ("model_parallel.py", ["--fast"], r"pipelineParallel=2: .*accuracy (0\.\d+) \(most common character: (0\.\d+)\)"),
    ("language_model.py", ["--fast"], r"generate: 'the big cat' -> '(sat|ran) "),
])
def test_examples_run_offline_and_meet_their_goals(script, args, goal, tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args], capture_output=True,
                          text=True, timeout=280, cwd=tmp_path, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.search(goal, proc.stdout)
    assert found, proc.stdout[-2000:]
    if script == "recommender.py":  # its goal: the model ranks held-out clicks better than item popularity
        model_auc, baseline_auc = float(found.group(1)), float(found.group(2))
        assert model_auc > baseline_auc + 0.03, found.group(0)
    if script == "model_parallel.py":  # both layouts train one model: beats always guessing the commonest
        accuracy, common = float(found.group(1)), float(found.group(2))
        assert accuracy > common + 0.05, found.group(0)
        tp, pp = re.findall(r"training loss by epoch ([\d. ]+);", proc.stdout)
        assert tp == pp  # the same weights, split two ways
