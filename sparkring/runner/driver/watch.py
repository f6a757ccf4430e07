"""What the driver decides while the stage runs: ranks that do not start, a run past its timeout,
a failed attempt Spark does not restart, every attempt failed."""
from __future__ import annotations

import logging
import time
from typing import Optional

from ...errors import RankTimeoutError
from .. import protocol
from .ledger import RunLedger
from .outcome import host_lost, no_attempt_left, not_restarted, rank_failed, timeout_error
from .plan import RUN_NAMES, LaunchPlan, ParamNames

log = logging.getLogger(__name__)
JOIN_WINDOW_S = 10.0
# How long a stage with one planned attempt may go on after a rank failed or went away before the
# driver ends it (the stage normally ends by itself at once, with the rank's own error).
LOST_GRACE_S = 3.0


class Watch:
    """What the driver decides while the stage runs: ranks that do not start, a run past its
    timeout, a failed attempt Spark does not restart, every attempt failed."""

    def __init__(self, state: RunLedger, launch_plan: LaunchPlan, start_timeout: float, timeout: Optional[float],
                 started: float, *, heartbeat_timeout: Optional[float] = None, names: ParamNames = RUN_NAMES):
        self.state, self.plan, self.start_timeout, self.timeout = state, launch_plan, start_timeout, timeout
        self.started = started
        self.heartbeat_timeout, self.names = heartbeat_timeout, names
        self.warned = False
        # Without a live channel expected from the start (a Connect client may be out of the
        # executors' reach), a missing hello is no sign of missing slots: the tasks' own
        # rendezvous timeout then decides.
        self.watches_start = launch_plan.stream and not launch_plan.facts.connect

    def failure(self) -> Optional[BaseException]:
        """The error the stage fails with now (ranks late to start, lost, failed); None while well."""
        state, num_proc, now = self.state, self.plan.num_proc, time.monotonic()
        if not self.plan.gang:  # an ordinary stage's tasks have no allGather to fall back on
            state.expire_joins(JOIN_WINDOW_S)
        with state.lock:
            attempt = state.attempt
            greeted = state.hello.get(attempt, set())
            since = state.attempt_started if state.hello else self.started
            arrived = set(state.arrived)
            failed_attempts = len(state.errors)
            failed_at = state.failed_at.get(attempt)
        late = len(greeted) < num_proc and now - since > self.start_timeout
        failure: Optional[BaseException] = None
        if late and self.watches_start and not state.detached:
            missing = sorted(set(range(num_proc)) - (arrived if len(arrived) < num_proc else greeted))
            why = ("the cluster may lack free slots (other jobs running?) or executors are still starting"
                   if not self.plan.gang else
                   f"dynamic allocation gave {num_proc - len(missing)} of them executors ({self.plan.limits})")
            failure = RankTimeoutError(
                f"ranks {missing} did not start within start_timeout={self.start_timeout:g}s; {why}", missing)
        elif late and not arrived and not self.warned:
            self.warned = True
            log.warning("no rank has reached this process (%s) within %gs: the cluster may lack free "
                        "slots, or the executors cannot reach it (the run then reports at its end)",
                        self.plan.driver_host, self.start_timeout)
        if self.timeout is not None and now - since > self.start_timeout + self.timeout + 30:
            running = sorted(set(range(num_proc)) - state.done.get(attempt, set()))
            failure = RankTimeoutError(f"ranks {running} exceeded timeout={self.timeout:g}s", running)
        if (failure is None and failed_at is not None and self.plan.attempts > 1 and self.watches_start
                and not state.detached and now - failed_at > self.start_timeout):
            failure = not_restarted(state, attempt, num_proc, self.start_timeout)
        if (failure is None and failed_at is not None and self.plan.attempts == 1 and self.watches_start
                and not state.detached and now - failed_at > LOST_GRACE_S):
            failure = no_attempt_left(state, attempt)
        if failure is None and failed_at is None:
            failure = self.silent_host()
        if failure is None and self.plan.attempts > 1 and failed_attempts >= self.plan.attempts:
            err = state.first_error()
            assert err is not None  # every attempt failed
            failure = (timeout_error(state, num_proc, self.timeout) if err.kind == protocol.TIMEOUT
                       else rank_failed(err, state))
        return failure

    def silent_host(self) -> Optional[BaseException]:
        """Running ranks whose tasks sent nothing (not even a beat) for the heartbeat timeout:
        their host is cut off. Only where every task reaches the driver live."""
        if self.heartbeat_timeout is None or not self.watches_start or self.state.detached:
            return None
        silent = self.state.silent_ranks(self.heartbeat_timeout)
        if not silent:
            return None
        return host_lost(self.state, silent, self.heartbeat_timeout, self.names.heartbeat_timeout)
