"""Several ranks per Spark task: the layout of the ranks, their GPUs (fake discovery on a
local-cluster), failures, and the training stage's own ResourceProfile."""
import pytest
import rank_fns
from leftovers import wait_no_workers

from sparkring import run
from sparkring.errors import ConfigurationError, RankFailedError


def test_two_tasks_of_two_ranks_make_one_ring_of_four_ordered_by_task(spark):
    results = run(rank_fns.whoami, num_proc=4, ranks_per_task=2)
    assert [r["rank"] for r in results] == [0, 1, 2, 3] and {r["size"] for r in results} == {4}
    assert [r["local_rank"] for r in results] == [0, 1, 2, 3]  # local[2]: every task on this host
    assert len({r["pid"] for r in results}) == 4 and {r["sum"] for r in results} == {6.0}
    assert wait_no_workers() == []


def test_a_failing_rank_of_a_two_rank_task_is_named_and_its_task_mate_stopped(spark):
    with pytest.raises(RankFailedError, match="rank 3") as info:
        run(rank_fns.fail_on_rank, args=(3,), num_proc=4, ranks_per_task=2, timeout=60)
    assert "boom on purpose in rank 3" in str(info.value)
    assert wait_no_workers() == []


def test_ranks_per_task_that_do_not_divide_the_ranks_are_refused_before_any_job(spark):
    with pytest.raises(ConfigurationError, match=r"num_proc=3 is not a multiple of ranks_per_task=2"):
        run(rank_fns.whoami, num_proc=3, ranks_per_task=2)
    with pytest.raises(ConfigurationError, match=r"num_proc=6 \(2 ranks per task: 3 tasks\) is larger than the 2"):
        run(rank_fns.whoami, num_proc=6, ranks_per_task=2)


def test_each_rank_of_a_two_gpu_task_gets_one_gpu_in_local_rank_order(spark_multigpu):
    # spark.task.resource.gpu.amount=1: resourceProfile="auto" asks two GPUs per task for the training stage
    results = run(rank_fns.whoami, num_proc=4, ranks_per_task=2, use_gpu=True, backend="gloo")
    assert [r["rank"] for r in results] == [0, 1, 2, 3] and {r["sum"] for r in results} == {6.0}
    # one host, four GPUs: each rank's CUDA_VISIBLE_DEVICES lists them all, and the ordinal it
    # computes on (set_device(local_rank)) is its own GPU
    [visible] = {r["cuda"] for r in results}
    assert sorted(visible.split(",")) == ["0", "1", "2", "3"]
    assert [r["gpu"] for r in results] == [str(r["local_rank"]) for r in results] == ["0", "1", "2", "3"]
    own = [visible.split(",")[int(r["gpu"])] for r in results]
    # ranks 0-1 hold one executor's two GPUs, ranks 2-3 the other's, in address order
    assert sorted([own[:2], own[2:]]) == [["0", "1"], ["2", "3"]]
    # the application's other stages keep one GPU per task: a plain run gets one rank per task
    single = run(rank_fns.whoami, num_proc=2, use_gpu=True, backend="gloo")
    assert {tuple(sorted(r["cuda"].split(","))) for r in single} == {("0", "2")}  # each executor's first GPU
    assert wait_no_workers() == []


def test_a_resource_profile_given_by_the_user_decides_the_ranks_per_task(spark_multigpu):
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    two_gpus = ResourceProfileBuilder().require(TaskResourceRequests().cpus(1).resource("gpu", 2)).build
    results = run(rank_fns.whoami, num_proc=4, use_gpu=True, backend="gloo", resource_profile=two_gpus)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert [r["gpu"] for r in results] == [str(r["local_rank"]) for r in results]
    with pytest.raises(ConfigurationError, match=r"ranks_per_task=2 with GPUs needs a multiple of 2 GPUs per task"):
        run(rank_fns.whoami, num_proc=4, ranks_per_task=2, use_gpu=True, backend="gloo", resource_profile="off")


class _SessionWithTwoGpusPerTask:
    """What TorchDistributor reads of a session whose tasks hold two GPUs each."""

    class conf:  # noqa: N801 - SparkSession.conf's shape
        @staticmethod
        def get(key, default=None):
            return "2" if key == "spark.task.resource.gpu.amount" else default


def test_torch_distributor_runs_one_process_per_gpu_of_each_task_as_spark_4_2_does():
    from sparkring import TorchDistributor

    d = TorchDistributor(num_processes=4, local_mode=False, use_gpu=True, spark=_SessionWithTwoGpusPerTask())
    assert d.input_params == {"num_processes": 4, "local_mode": False, "use_gpu": True, "num_tasks": 2}
    with pytest.raises(ConfigurationError, match=r"num_processes=3 with spark.task.resource.gpu.amount=2"):
        TorchDistributor(num_processes=3, local_mode=False, use_gpu=True, spark=_SessionWithTwoGpusPerTask())
