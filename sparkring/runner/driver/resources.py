"""The training stage's resources, decided once for the launch plan: how many ranks each task runs
and the stage-level ResourceProfile the barrier stage asks for (so an application's ETL and
transform keep their own task resources)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ...errors import ConfigurationError
from .session import SessionFacts, spark_major

log = logging.getLogger(__name__)

PROFILE_MODES = ("auto", "off")


@dataclass(frozen=True)
class StageResources:
    """What each task of the training stage holds and runs.

    >>> StageResources(ranks_per_task=2, profile=None, task_gpus=2.0).ranks_per_task
    2
    """

    ranks_per_task: int
    profile: Any                    # a pyspark ResourceProfile, or None: the application's task resources
    task_gpus: float                # GPUs each task holds (0: none scheduled)


def profile_task_amounts(profile) -> Tuple[Optional[int], float]:
    """The CPUs (None: the application's) and GPUs per task a pyspark ResourceProfile asks for.

    >>> from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests
    >>> profile_task_amounts(ResourceProfileBuilder().require(TaskResourceRequests().cpus(2)).build)  # doctest: +SKIP
    (2, 0.0)
    """
    requests = profile.taskResources or {}
    cpus = requests.get("cpus")
    gpus = requests.get("gpu")
    return (int(cpus.amount) if cpus is not None else None), (float(gpus.amount) if gpus is not None else 0.0)


def why_no_task_profiles(facts: SessionFacts) -> Optional[str]:
    """Why this session cannot give one stage its own task resources (None: it can)."""
    if facts.local:
        return f"master {facts.master} (local mode) has no stage-level scheduling"
    if spark_major() < 4:
        return "Spark 3.5's mapInArrow takes no ResourceProfile (Spark 4.0 and later do)"
    return None


def training_profile(cpus: int, gpus: float):
    """A task-only ResourceProfile: ``cpus`` CPUs and ``gpus`` GPUs per task of the training stage
    (standalone, YARN and Kubernetes give it to a stage with dynamic allocation on or off)."""
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    requests = TaskResourceRequests().cpus(cpus)
    if gpus > 0:
        requests = requests.resource("gpu", gpus)
    return ResourceProfileBuilder().require(requests).build


def default_ranks_per_task(use_gpu: bool, task_gpus: float) -> int:
    """One rank per GPU of a task that holds several whole GPUs, else one rank.

    >>> default_ranks_per_task(True, 2.0), default_ranks_per_task(True, 0.5), default_ranks_per_task(False, 4.0)
    (2, 1, 1)
    """
    if use_gpu and task_gpus >= 2 and float(task_gpus).is_integer():
        return int(task_gpus)
    return 1


def stage_resources(facts: SessionFacts, use_gpu: bool, num_proc: Optional[int], ranks_per_task: Optional[int],
                    resource_profile: Any, names) -> StageResources:
    """Decide ranks per task and the training stage's profile; refuse what cannot match, naming
    the caller's parameters and the fix."""
    explicit = resource_profile is not None and not isinstance(resource_profile, str)
    if not explicit and resource_profile not in PROFILE_MODES:
        raise ConfigurationError(f"{names.resource_profile}={resource_profile!r}: use 'auto', 'off' or a "
                                 "pyspark.resource.ResourceProfile")
    unsupported = why_no_task_profiles(facts)
    if explicit and unsupported:
        raise ConfigurationError(f"{names.resource_profile} was given, but {unsupported}: pass "
                                 f"{names.resource_profile}='off' and set the task resources in the Spark conf")
    task_gpus = profile_task_amounts(resource_profile)[1] if explicit else facts.task_gpus
    k = default_ranks_per_task(use_gpu, task_gpus) if ranks_per_task is None else int(ranks_per_task)
    if k < 1:
        raise ConfigurationError(f"{names.ranks_per_task}={ranks_per_task}: it must be at least 1")
    if num_proc is not None and num_proc % k:
        raise ConfigurationError(f"{names.num_proc}={num_proc} is not a multiple of {names.ranks_per_task}={k}: "
                                 f"each task runs {k} ranks")
    profile = resource_profile if explicit else None
    wanted_gpus = float(k) if use_gpu else 0.0
    if use_gpu and not explicit and task_gpus != wanted_gpus and ranks_per_task is not None:
        if resource_profile == "auto" and unsupported is None and not facts.connect:
            profile = training_profile(facts.task_cpus, wanted_gpus)
            task_gpus = wanted_gpus
            log.info("the training stage asks for %g GPU(s) per task (%d ranks of one GPU) through a "
                     "ResourceProfile; the application's other stages keep spark.task.resource.gpu.amount=%g",
                     wanted_gpus, k, facts.task_gpus)
        elif task_gpus % k:
            why = unsupported or ("resourceProfile is 'off'" if resource_profile == "off" else "this is Spark Connect")
            raise ConfigurationError(
                f"{names.ranks_per_task}={k} with GPUs needs a multiple of {k} GPUs per task, but "
                f"spark.task.resource.gpu.amount={task_gpus:g} and no ResourceProfile can ask for more ({why}): "
                f"set spark.task.resource.gpu.amount={k} (with spark.executor.resource.gpu.amount)")
    if use_gpu and task_gpus and float(task_gpus).is_integer() and int(task_gpus) % k:
        raise ConfigurationError(f"{names.ranks_per_task}={k} does not divide the {task_gpus:g} GPUs each task holds: "
                                 f"use a divisor of {task_gpus:g}")
    return StageResources(ranks_per_task=k, profile=profile, task_gpus=task_gpus)
