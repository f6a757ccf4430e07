"""sparkring.doctor / python -m sparkring doctor on real Spark sessions."""
import sys

import pytest

import sparkring
from sparkring import Store
from sparkring.runner.driver import doctor as doctor_module


@pytest.mark.compat
def test_doctor_reports_a_healthy_session_as_ready(spark):
    report = sparkring.doctor(spark)
    assert report.ok, report
    assert report.problems == []
    assert len(report.executors) == 1 and report.executors[0].tasks == 2  # local[2]: the driver runs both
    for e in report.executors:
        assert e.facts.versions == report.driver_versions
        assert e.facts.driver_reachable and e.facts.python_executable == sys.executable
        assert e.facts.mpiexec and e.facts.mpi4py and e.facts.shm_free_bytes > 0
    text = str(report)
    assert text.splitlines()[-1] == "verdict: ready to train"
    assert all(f"executor {e.executor}" in text for e in report.executors)


def test_doctor_names_each_executor_whose_gpus_torch_cannot_see(spark_cluster):
    # the test cluster's workers hand out a fake GPU "0" each: a CPU build of torch sees none
    report = sparkring.doctor(spark_cluster)
    assert not report.ok
    assert len(report.executors) == 2 and [e.tasks for e in report.executors] == [1, 1]
    assert [(p.where, p.what, p.fatal) for p in report.problems] == [
        (f"executor {e.executor}", "Spark assigned GPU(s) ['0'] but torch sees none", True)
        for e in report.executors]
    assert "install a CUDA build of torch" in report.problems[0].fix
    assert "2 problem(s) would break a fit" in str(report)
    assert "1 GPU(s) per task: 1 rank(s) per task by default" in str(report)


def test_doctor_names_the_executor_whose_versions_differ_from_the_driver(spark, monkeypatch):
    real = doctor_module.package_versions()
    # the driver claims other versions (the executors run the real code and report theirs)
    monkeypatch.setattr(doctor_module, "package_versions", lambda: {**real, "torch": "2.12.1", "pyarrow": "19.0.0"})
    report = sparkring.doctor(spark)
    assert not report.ok
    [problem] = report.problems
    assert problem.where == f"executor {report.executors[0].executor}" and problem.fatal
    assert problem.what == (f"other versions than the driver's: torch {real['torch']} (driver 2.12.1), "
                            f"pyarrow {real['pyarrow']} (driver 19.0.0)")
    assert "spark.archives" in problem.fix


def test_doctor_runs_on_a_spark_connect_session(spark_connect):
    report = sparkring.doctor(spark_connect)
    assert report.ok, report
    assert sum(e.tasks for e in report.executors) == 2  # the server's local[2,2]
    assert all(e.facts.versions == report.driver_versions and e.facts.driver_reachable for e in report.executors)


def test_doctor_says_when_the_cluster_cannot_run_the_barrier_stage(spark):
    report = sparkring.doctor(spark, num_tasks=5, timeout=3)
    assert not report.ok and report.executors == []
    assert report.problems[0].where == "cluster" and "barrier stage of 5 task(s)" in report.problems[0].what


def test_doctor_command_line_prints_the_report_and_exits_by_its_verdict(spark, capsys):
    # in-process on the session at hand (as under spark-submit); the command as a process runs
    # against a standalone cluster in tests/integration/test_standalone.py
    from sparkring.__main__ import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "sparkring doctor: master local[2], 2 task slot(s)" in out
    assert out.strip().splitlines()[-1] == "verdict: ready to train"
    assert main(["doctor", "-np", "5", "--timeout", "3"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("verdict:")


pytestmark = pytest.mark.slow


def test_doctor_checks_that_every_executor_writes_to_the_store(spark, s3):
    report = sparkring.doctor(spark, store=s3.store("doctor"))
    assert report.ok, report
    assert [e.facts.store_error for e in report.executors] == [""]  # written, read back and removed
    assert s3.store("doctor").listdir(s3.store("doctor").root) == []
    closed = Store("s3://runs/x", storage_options={**s3.storage_options, "endpoint_url": "http://127.0.0.1:9"})
    report = sparkring.doctor(spark, store=closed)
    assert not report.ok
    [problem] = report.problems
    assert problem.what.startswith("cannot write to the Store (EndpointConnectionError") and problem.fatal
