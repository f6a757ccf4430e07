"""Writes Horovod's own Spark test files to run against sparkring.spark with only their imports changed.

Horovod's ``test/integration/test_spark_torch.py`` and ``test_spark_lightning.py`` (and the two helper
modules of ``test/utils`` they import) are copied from a Horovod checkout or git directory; each line
importing Horovod's public API imports sparkring's instead (``IMPORTS``), and each line importing
Horovod's internals imports them from ``horovod_internals.py``, written beside them, which holds
nothing the tests left out do not need. The tests of those internals are left out by name with the
reason (``deselect.args``, ``LEFT_OUT.md``). CI cannot fetch Horovod: this runs by hand, and each
failure class it finds gets a test of the project's own (tests/spark/test_horovod_spark.py).

    python conformance/make_horovod_spark_suite.py /work/.mirror/horovod+horovod/repo /tmp/hvd-spark
    cd /tmp/hvd-spark && PYTHONPATH=test/integration:test/utils SPARK_LOCAL_IP=127.0.0.1 \\
        PYSPARK_PYTHON=$VENV/bin/python $VENV/bin/python -m pytest test/integration $(cat deselect.args)

(Horovod's files need the ``mock`` package, which sparkring's environment does not carry:
``pip install mock`` into the environment that runs them.)
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
from typing import List

FILES = ["test/integration/test_spark_torch.py", "test/integration/test_spark_lightning.py",
         "test/utils/common.py", "test/utils/spark_common.py"]

# Horovod's public API, as sparkring names it (docs/horovod.md's table)
IMPORTS = {
    "import horovod": "import sparkring as horovod",
    "import horovod.spark.torch as hvd_spark": "import sparkring.spark.torch as hvd_spark",
    "import horovod.spark.lightning as hvd_spark": "import sparkring.spark.lightning as hvd_spark",
    "import horovod.torch as hvd": "import sparkring.collective as hvd",
    "from horovod.torch.elastic import run": "from sparkring.collective.elastic import run",
    "from horovod.spark.common import constants, util": "from sparkring.spark.common import constants, util",
    "from horovod.spark.common.store import LocalStore": "from sparkring.spark.common.store import LocalStore",
}

# tests of Horovod's internals, and why each is left out
LEFT_OUT = {
    "test_spark_torch.py": {
        "test_fit_model_nvtabular": "NVTabular (not on PyPI for this Python)",
        "test_pytorch_get_optimizer_with_unscaled_lr": "remote._get_optimizer_with_unscaled_lr, Horovod's internal",
        "test_metric_class": "remote._metric_cls, Horovod's internal",
        "test_construct_metric_value_holders_one_metric_for_all_labels":
            "remote._construct_metric_value_holders, Horovod's internal",
        "test_prepare_np_data": "remote._prepare_np_data and util.to_petastorm_fn, Horovod's internals",
        "test_get_metric_avgs": "remote._get_metric_avgs, Horovod's internal",
        "test_update_metrics": "remote._update_metrics, Horovod's internal",
        "test_torch_param_serialize": "estimator._torch_param_serialize, Horovod's internal",
        "test_calculate_loss_with_sample_weight": "remote._calculate_loss_fn, Horovod's internal",
        "test_calculate_loss_without_sample_weight": "remote._calculate_loss_fn, Horovod's internal",
    },
    "test_spark_lightning.py": {
        "test_prepare_data": "util.to_petastorm_fn and remote's internals",
        "test_torch_param_serialize": "estimator._torch_param_serialize, Horovod's internal",
        "test_direct_parquet_train_with_no_val_column": "util.to_petastorm_fn, Horovod's internal",
        "test_legacy_calculate_loss_with_sample_weight": "legacy.to_lightning_module, Horovod's internal",
        "test_legacy_calculate_loss_without_sample_weight": "legacy.to_lightning_module, Horovod's internal",
        "test_train_with_custom_data_module":
            "its data module loads batches with horovod.spark.data_loaders' PytorchAsyncDataLoader, Horovod's "
            "internal",
    },
}

INTERNALS = '''"""Horovod's internals that the copied test files import: each test using them is left out
(LEFT_OUT.md); what remains here only lets the files import."""
import threading

MIN_PL_VERSION = "1.3.8"


def gloo_built():
    return True  # sparkring's collectives run on gloo


def mpi_built():
    return True


def is_open_mpi():
    return False


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


class _LeftOut:
    def __init__(self, name):
        self.name = name

    def __getattr__(self, attr):
        raise RuntimeError(f"{self.name}.{attr} is Horovod's internal: the test using it is left out")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} is Horovod's internal: the test using it is left out")


remote = _LeftOut("remote")
secret = _LeftOut("secret")
EstimatorParams = _LeftOut("EstimatorParams")
_torch_param_serialize = _LeftOut("_torch_param_serialize")
to_lightning_module = _LeftOut("to_lightning_module")
_wait_file_available_on_dbfs = _LeftOut("_wait_file_available_on_dbfs")
_get_spark_df_saved_file_list = _LeftOut("_get_spark_df_saved_file_list")
SparkDriverService = SparkDriverClient = _LeftOut("driver_service")
SparkTaskService = SparkTaskClient = _LeftOut("task_service")
PytorchAsyncDataLoader = _LeftOut("PytorchAsyncDataLoader")
'''


def read(source: str, path: str) -> str:
    """A file of Horovod at ``source``: a checkout, or a git directory (its HEAD)."""
    if os.path.isfile(os.path.join(source, path)):
        with open(os.path.join(source, path)) as f:
            return f.read()
    return subprocess.run(["git", f"--git-dir={source}", "show", f"HEAD:{path}"], check=True,
                          capture_output=True, text=True).stdout


def change_imports(text: str) -> str:
    """Horovod's import lines as sparkring's; its internals from horovod_internals."""
    lines = []
    for line in text.splitlines():
        stripped, indent = line.strip(), line[:len(line) - len(line.lstrip())]
        if stripped in IMPORTS:
            line = indent + IMPORTS[stripped]
        elif re.match(r"from horovod\.\S+ import ", stripped):
            line = indent + re.sub(r"^from horovod\.\S+ import ", "from horovod_internals import ", stripped)
        elif re.match(r"import horovod\b", stripped):
            raise ValueError(f"an import of Horovod with no counterpart: {stripped}")
        lines.append(line)
    return "\n".join(lines) + "\n"


def write_suite(source: str, out: str) -> List[str]:
    """Write the changed files, horovod_internals.py and the left-out list into ``out``; the
    pytest arguments that leave those tests out."""
    deselect = []
    for path in FILES:
        target = os.path.join(out, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write(change_imports(read(source, path)))
        with open(os.path.join(os.path.dirname(target), "horovod_internals.py"), "w") as f:
            f.write(INTERNALS)
    classes = {"test_spark_torch.py": "SparkTorchTests", "test_spark_lightning.py": "SparkLightningTests"}
    lines = ["# Horovod's Spark tests left out, and why", ""]
    for name, tests in LEFT_OUT.items():
        for test, why in tests.items():
            deselect.append(f"--deselect=test/integration/{name}::{classes[name]}::{test}")
            lines.append(f"- `{name}::{test}`: {why}")
    with open(os.path.join(out, "deselect.args"), "w") as f:
        f.write(" ".join(deselect) + "\n")
    with open(os.path.join(out, "LEFT_OUT.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return deselect


def main() -> None:
    """Command line: the Horovod source, the folder to write."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("horovod", help="a Horovod checkout or git directory")
    parser.add_argument("out", help="the folder to write the suite into")
    args = parser.parse_args()
    left_out = write_suite(args.horovod, args.out)
    print(f"wrote {args.out}: {len(left_out)} tests left out (LEFT_OUT.md)")


if __name__ == "__main__":
    main()
