"""What a launch's end means for the caller: the error to raise (a rank's failure, a timeout with
every rank's stacks, lost executors, too few slots, a cancelled job) from the ledger and the stage's outcome."""
from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional

from ...errors import HostLostError, RankFailedError, RankTimeoutError, SparkRingError, StageLostError
from .. import protocol
from ..protocol import Error
from .ledger import RunLedger
from .stage import StageOutcome

log = logging.getLogger(__name__)


def raise_for_outcome(state: RunLedger, outcome: StageOutcome, num_proc: int, start_timeout: float,
                      timeout: Optional[float]) -> None:
    """The stage ended: replay the frames its records carry, and raise what went wrong, if anything."""
    if outcome.error is not None:
        log.debug("the barrier stage failed: %s", outcome.error)
    else:  # the stage ended: what failed in attempts Spark retried is history
        with state.lock:
            state.errors.clear()
            state.timeouts.clear()
    for record in outcome.messages():
        state.handle(record.frame())
    err = state.first_error()
    if err is None and outcome.error is not None:
        err = protocol.found_error(str(outcome.error))
    if err is not None:
        if err.kind == protocol.TIMEOUT:
            state.timeouts.setdefault(err.attempt, {})[err.rank] = err.traceback
            raise timeout_error(state, num_proc, timeout, wait=not outcome.records) from None
        raise rank_failed(err, state) from None
    error = outcome.error
    if error is None:
        return
    if outcome.slots_refused:
        raise RankTimeoutError(f"the cluster did not offer {num_proc} concurrent task slots within "
                               f"start_timeout={start_timeout:g}s: add executors/cores or lower the "
                               "number of ranks", list(range(num_proc))) from None
    if outcome.cancelled:
        raise SparkRingError("the Spark job of this run was cancelled (cancelAllJobs, a job group or tag "
                             "cancel, or the Spark UI); its ranks were stopped") from error
    raise stage_lost(state, f"the barrier stage failed before any rank reported an error: {error}") from error


def not_restarted(state: RunLedger, attempt: int, num_proc: int, start_timeout: float) -> RankTimeoutError:
    """An attempt of the stage failed and Spark has not started the next one: its slots are gone."""
    err = state.errors.get(attempt)
    if err is not None:
        lines = [line for line in err.traceback.strip().splitlines() if line.strip()]
        cause = f"rank {err.rank}: {lines[-1].strip() if lines else 'failed'}"
    else:
        cause = "a rank's task went away without a word (its executor was lost)"
    return RankTimeoutError(
        f"attempt {attempt + 1} of the barrier stage failed ({cause}) and Spark did not start the {num_proc} "
        f"ranks again within start_timeout={start_timeout:g}s: the cluster lacks {num_proc} free task slots "
        "(an executor was lost and did not come back, or other jobs hold the slots); add executors or lower "
        "the number of ranks", list(range(num_proc)))


def no_attempt_left(state: RunLedger, attempt: int) -> BaseException:
    """A rank of the only planned attempt failed or went away and the stage has not ended (Spark
    may be waiting to rerun the barrier tasks on slots that are gone): the run ends here."""
    err = state.errors.get(attempt)
    if err is not None:
        return rank_failed(err, state)
    return stage_lost(state, "a rank's task went away without a word (its executor was lost) and no other "
                              "attempt of the barrier stage is planned")


def rank_failed(err: Error, state: RunLedger) -> RankFailedError:
    """The RankFailedError a rank's Error frame means, naming its executor."""
    return RankFailedError(err.rank, err.traceback, err.exit_code, executor=state.executor_of(err.rank, err.attempt),
                           exception_type=err.exception_type, message=err.message)


def stage_lost(state: RunLedger, what: str) -> StageLostError:
    """The stage ended, or cannot go on, because tasks went away: the message names their ranks
    and executors where the driver saw them go."""
    lost = state.lost_ranks()
    gone = ", ".join(f"rank {rank}" + (f" (executor {where})" if where else "") for rank, where in lost.items())
    return StageLostError(f"{what}" + (f"; tasks that went away: {gone}" if gone else ""), lost=lost)


def host_lost(state: RunLedger, silent: Dict[int, str], heartbeat_timeout: float,
              name: str = "heartbeat_timeout") -> HostLostError:
    """Ranks whose tasks fell silent: the error names them, their hosts and their executors."""
    attempt = state.attempt
    by_host: Dict[str, List[int]] = {}
    for rank, host in silent.items():
        by_host.setdefault(host or "an unknown host", []).append(rank)
    where = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on host {host}"
                      for host, ranks in by_host.items())
    lost = {rank: state.executor_of(rank, attempt) or "" for rank in silent}
    return HostLostError(
        f"{where}: no word from {'their tasks' if len(silent) > 1 else 'its task'} for {name}="
        f"{heartbeat_timeout:g}s, so the host no longer reaches the driver (a link down, packets dropped, "
        "the machine hung) or its executor froze; the other ranks were stopped", lost=lost, hosts=dict(silent))


def timeout_error(state: RunLedger, num_proc: int, timeout: Optional[float], wait: bool = True) -> RankTimeoutError:
    """Name the ranks that ran out of time, with where every rank's threads were."""
    attempt = max(state.timeouts)
    deadline = time.monotonic() + (3 if wait else 0)  # live: the other ranks' stack dumps are on their way
    while time.monotonic() < deadline:
        with state.lock:
            have = set(state.timeouts.get(attempt, {})) | set(state.stacks.get(attempt, {}))
        if len(have) >= num_proc:
            break
        time.sleep(0.05)
    with state.lock:
        timed = dict(state.timeouts.get(attempt, {}))
        stacks = dict(state.stacks.get(attempt, {}))
    ranks = sorted(timed)
    parts = [timed[r] for r in ranks]
    parts += [f"rank {r} was stopped with them; where its threads were:\n{stacks[r]}"
              for r in sorted(stacks) if r not in timed]
    limit = f"timeout={timeout:g}s" if timeout is not None else "their collective timeout"
    return RankTimeoutError(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} exceeded "
                            f"{limit} and {'were' if len(ranks) > 1 else 'was'} killed\n\n"
                            + "\n\n".join(parts), ranks)
