"""Launch ranks as a Spark barrier stage: ``run(fn, num_proc=2)``.

>>> from sparkring.runner import run
>>> run(lambda: 42, num_proc=2)  # doctest: +SKIP
[42, 42]
"""
from ..collective.elastic import Relaunches
from ..errors import ConfigurationError, RankFailedError, RankTimeoutError, SparkRingError
from .channel import measure_link, report
from .driver.elastic import ElasticLaunch, ElasticPolicy, relaunch_until_done
from .driver.interpreter import check_executor_interpreter
from .driver.launch import launch, run
from .driver.ledger import RankOutput
from .driver.plan import ESTIMATOR_NAMES, LaunchPlan, LaunchRequest, ParamNames, check_timeouts, plan, plan_for
from .driver.session import spark_major
from .pickling import check_picklable, to_bytes

__all__ = ["run", "launch", "RankOutput",
           "plan", "plan_for", "LaunchPlan", "LaunchRequest", "ParamNames", "ESTIMATOR_NAMES",
           "check_executor_interpreter", "measure_link", "report", "check_picklable", "to_bytes", "spark_major",
           "check_timeouts", "ElasticLaunch", "ElasticPolicy", "Relaunches", "relaunch_until_done",
           "ConfigurationError", "RankFailedError", "RankTimeoutError", "SparkRingError"]
