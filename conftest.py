"""The docstring examples of sparkring/ run as tests (the fast layer), with the names a user's
script has imported."""
import importlib.util
from pathlib import Path

import numpy
import pytest
import torch
from _pytest.doctest import DoctestModule

import sparkring.collective

PACKAGE = Path(__file__).parent / "sparkring"
EXTRAS = {"tune": "optuna"}  # a subpackage whose examples need its extra (absent from the compat environment)


def pytest_collect_file(file_path, parent):
    if file_path.suffix == ".py" and PACKAGE in file_path.parents:
        needs = EXTRAS.get(file_path.relative_to(PACKAGE).parts[0])
        if needs is not None and importlib.util.find_spec(needs) is None:
            return None
        return DoctestModule.from_parent(parent, path=file_path)
    return None


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update(sr=sparkring.collective, torch=torch, np=numpy)


def pytest_collection_modifyitems(items):
    """A docstring whose every example is marked +SKIP is not a test: leave it out."""
    import doctest

    def runnable(item) -> bool:
        test = getattr(item, "dtest", None)
        return test is None or any(not ex.options.get(doctest.SKIP, False) for ex in test.examples)

    items[:] = [item for item in items if runnable(item)]
