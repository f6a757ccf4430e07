"""The launch plan, decided before any Spark job from what the session offers (fast layer)."""
import sys
import types

import pytest

from sparkring import ConfigurationError
from sparkring.runner import plan


def _session(master, **conf):
    conf = dict(conf, **{"spark.master": master})
    return types.SimpleNamespace(conf=types.SimpleNamespace(get=lambda k, d=None: conf.get(k, d)),
                                 sparkContext=types.SimpleNamespace(resources={}))


def test_the_plan_takes_every_slot_by_default_and_refuses_more_ranks_than_slots_naming_the_param():
    assert plan(_session("local[3]")).num_proc == 3
    with pytest.raises(ConfigurationError, match=r"num_proc=4 is larger than the 3 concurrent task slots.*"
                                                 r"lower num_proc to at most 3"):
        plan(_session("local[3]"), 4)


def test_the_plan_counts_slots_of_a_local_cluster_by_task_cpus():
    assert plan(_session("local-cluster[2,4,1024]", **{"spark.task.cpus": "2"})).num_proc == 4


def test_the_plan_refuses_unknown_backends_zero_ranks_and_nccl_without_gpus_before_any_job():
    with pytest.raises(ConfigurationError, match="backend='tcp' is not known"):
        plan(_session("local[2]"), 2, backend="tcp")
    with pytest.raises(ConfigurationError, match="num_proc=0: it must be at least 1"):
        plan(_session("local[2]"), 0)
    with pytest.raises(ConfigurationError, match="backend='nccl' needs GPUs"):
        plan(_session("local[2]"), 2, backend="nccl")


def test_the_plan_takes_its_attempts_from_the_stage_attempts_where_the_master_allows_retries():
    assert plan(_session("local[2]"), 2).attempts == 1
    # Spark reruns a barrier stage up to spark.stage.maxConsecutiveAttempts times (4), whatever F > 1 says
    assert plan(_session("local[2,3]"), 2).attempts == 4
    assert plan(_session("local[2,2]", **{"spark.stage.maxConsecutiveAttempts": "3"}), 2).attempts == 3
    assert plan(_session("local-cluster[2,1,1024]", **{"spark.task.maxFailures": "1"}), 2).attempts == 1


def test_the_plan_refuses_the_mpi_backend_on_open_mpi_naming_the_library_and_the_fix(monkeypatch):
    import sparkring.runner._probe as probe

    monkeypatch.setattr(probe, "find_mpiexec", lambda: "/usr/bin/mpiexec")
    monkeypatch.setattr(probe, "mpi_library", lambda: "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6")
    with pytest.raises(ConfigurationError, match=r"backend='mpi' runs on MPICH, but mpi4py here runs on "
                                                 r"Open MPI v4.1.6: .*mpich wheel.*backend='gloo'"):
        plan(_session("local[2]"), 2, backend="mpi")


def test_the_mpi_library_is_read_without_initialising_mpi_in_the_driver():
    pytest.importorskip("mpi4py")
    from sparkring.runner._probe import mpi_library

    initialised_before = "mpi4py.MPI" in sys.modules
    assert mpi_library().startswith("MPICH")  # the mpich wheel sparkring[mpi] installs
    assert ("mpi4py.MPI" in sys.modules) == initialised_before
