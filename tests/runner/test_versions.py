"""The package versions that must agree between the driver and every executor (fast layer)."""
import torch

from sparkring.runner.versions import package_versions, skew


def test_versions_differing_in_a_local_build_tag_agree_and_a_missing_package_is_named():
    driver = {"torch": "2.13.0+cpu", "pyarrow": "25.0.1", "python": "3.11.7"}
    assert skew(driver, {"a": {"torch": "2.13.0+cu128", "pyarrow": "25.0.0", "python": "3.11.9"}}) == []
    assert skew(driver, {"b": {"torch": "2.13.0", "python": "3.11.7"}}) == ["b: pyarrow missing (driver 25.0.1)"]
    assert skew(driver, {"c": {"torch": "2.13.0", "pyarrow": "25.0.1", "python": "3.12.1"}}) == [
        "c: python 3.12.1 (driver 3.11.7)"]


def test_this_process_reports_the_versions_it_runs():
    versions = package_versions()
    assert versions["torch"] == torch.__version__ and versions["python"].count(".") == 2
