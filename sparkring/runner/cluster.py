"""What the Spark session can run: task slots, GPUs, barrier-mode preconditions."""
from __future__ import annotations

import os
import re
from typing import List, Optional

from .errors import ConfigurationError


def _conf(sc, key: str, default: Optional[str] = None) -> Optional[str]:
    return sc.getConf().get(key, default)


def is_local(sc) -> bool:
    return sc.master.startswith("local") and not sc.master.startswith("local-cluster")


def task_cpus(sc) -> int:
    return int(_conf(sc, "spark.task.cpus", "1"))


def task_gpus(sc) -> float:
    return float(_conf(sc, "spark.task.resource.gpu.amount", "0") or 0)


def driver_gpus(sc) -> List[str]:
    """GPU addresses the driver discovered (used by local mode)."""
    try:
        info = sc.resources.get("gpu")
    except Exception:  # noqa: BLE001 - older/connect contexts have no resources
        info = None
    return list(info.addresses) if info is not None else []


def task_slots(sc, use_gpu: bool) -> int:
    """How many tasks of a barrier stage can run at once on this session."""
    master = sc.master
    cpus = task_cpus(sc)
    m = re.fullmatch(r"local(?:\[(\*|\d+)(?:\s*,\s*\d+)?\])?", master)
    if m:
        n = m.group(1)
        if n is None:
            cores = 1
        elif n == "*":
            cores = os.cpu_count() or 1
        else:
            cores = int(n)
        slots = cores // cpus
        if use_gpu:
            per_task = task_gpus(sc) or 1
            slots = min(slots, int(len(driver_gpus(sc)) // per_task))
        return slots
    m = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master)
    if m:
        executors, cores = int(m.group(1)), int(m.group(2))
        slots = executors * (cores // cpus)
        if use_gpu:
            per_exec = float(_conf(sc, "spark.executor.resource.gpu.amount", "0") or 0)
            slots = min(slots, executors * int(per_exec // task_gpus(sc)))
        return slots
    # A real cluster: ask the scheduler (exact once executors have registered); Spark's
    # internal API can change between versions, so fall back to the default parallelism.
    try:
        jsc = sc._jsc.sc()
        profile = sc._jvm.org.apache.spark.resource.ResourceProfile.getOrCreateDefaultProfile(jsc.conf())
        slots = int(jsc.maxNumConcurrentTasks(profile))
        if slots > 0:
            return slots
    except Exception:  # noqa: BLE001
        pass
    return int(sc.defaultParallelism)


def task_max_failures(sc) -> int:
    """How many times Spark may run a task: local[N,F] says F, local[N] means 1, clusters
    read spark.task.maxFailures (default 4)."""
    m = re.fullmatch(r"local\[(?:\*|\d+)\s*,\s*(\d+)\]", sc.master)
    if m:
        return int(m.group(1))
    if is_local(sc):
        return 1
    return int(_conf(sc, "spark.task.maxFailures", "4"))


def default_use_gpu(sc) -> bool:
    return task_gpus(sc) > 0


def check_session(sc, num_proc: int, use_gpu: bool) -> None:
    """Raise ConfigurationError for anything that would make the barrier stage fail or hang."""
    if num_proc < 1:
        raise ConfigurationError(f"num_proc={num_proc}: it must be at least 1")
    if not is_local(sc) and (_conf(sc, "spark.dynamicAllocation.enabled", "false") or "").lower() == "true":
        raise ConfigurationError(
            "spark.dynamicAllocation.enabled=true: Spark's barrier mode does not support dynamic "
            "allocation; set spark.dynamicAllocation.enabled=false for this application")
    if use_gpu:
        if is_local(sc):
            if not driver_gpus(sc):
                raise ConfigurationError(
                    "use_gpu=True in local mode but the driver has no GPUs: set "
                    "spark.driver.resource.gpu.amount and spark.driver.resource.gpu.discoveryScript")
        elif task_gpus(sc) <= 0:
            raise ConfigurationError(
                "use_gpu=True but spark.task.resource.gpu.amount is not set: set it (usually 1) "
                "with spark.executor.resource.gpu.amount so Spark schedules one GPU per task")
    slots = task_slots(sc, use_gpu)
    if num_proc > slots:
        what = "GPU task slots" if use_gpu else "task slots"
        raise ConfigurationError(
            f"num_proc={num_proc} is larger than the {slots} concurrent {what} of this session "
            f"(master {sc.master}, spark.task.cpus={task_cpus(sc)}); a barrier stage needs all its "
            f"tasks running at once: lower num_proc to at most {slots} or add executors/cores")
