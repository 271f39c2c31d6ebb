"""Fault injection for tests and benchmarks: kill a chosen rank at a chosen step of an attempt.

``LIGHTNING_ETT_FAULT_KILL="RANK:STEP[:ATTEMPT][,...]"`` makes :class:`~lightning_ett.ETTMonitor`
SIGKILL global rank ``RANK`` right after optimizer step ``STEP`` (``trainer.global_step``)
finished, in attempt ``ATTEMPT`` of the job (default 0), so the restart path runs exactly as
after a real crash: no handler, no flush, no goodbye. ``"1:40"`` kills rank 1 at step 40 of
the first attempt; ``"1:40,0:90:1"`` also kills rank 0 at step 90 of the second.

``LIGHTNING_ETT_FAULT_MTBF_S="SECONDS[:SEED]"`` injects a failure *rate* instead: in each
attempt one rank, drawn from (seed, attempt), SIGKILLs itself at the first step boundary
after an exponentially distributed time (mean ``SECONDS``) of training in that attempt
(counted from its first batch: a failure during start-up costs every setting the same, so it
would only add noise to a comparison). The draws depend only on the seed and the attempt
number, so jobs with different settings (e.g. checkpoint cadences) meet the same failures.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from dataclasses import dataclass

ENV_FAULT_KILL = "LIGHTNING_ETT_FAULT_KILL"
ENV_FAULT_MTBF = "LIGHTNING_ETT_FAULT_MTBF_S"


@dataclass(frozen=True)
class KillFault:
    rank: int
    step: int
    attempt: int = 0


def parse_kill_faults(value: str | None) -> tuple[KillFault, ...]:
    """Parse the switch's value; a malformed one is an error naming the variable and the format."""
    if not value or not value.strip():
        return ()
    faults = []
    for item in value.split(","):
        parts = item.strip().split(":")
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            numbers = []
        if len(numbers) not in (2, 3) or min(numbers) < 0:
            raise ValueError(
                f"{ENV_FAULT_KILL}={value!r}: expected RANK:STEP[:ATTEMPT] (non-negative integers), comma-separated, "
                "e.g. '1:40' to SIGKILL rank 1 after step 40 of attempt 0."
            )
        faults.append(KillFault(*numbers))
    return tuple(faults)


def faults_from_env() -> tuple[KillFault, ...]:
    return parse_kill_faults(os.environ.get(ENV_FAULT_KILL))


def maybe_kill(faults: tuple[KillFault, ...], rank: int, step: int, attempt: int) -> None:
    """SIGKILL this process if a fault names this rank, step and attempt."""
    if KillFault(rank, step, attempt) in faults:
        print(f"lightning-ett fault injection: SIGKILL rank {rank} at step {step} of attempt {attempt}",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class RandomFailures:
    """Failures at a rate: one per attempt, after an exponential time with mean ``mtbf_s``."""

    mtbf_s: float
    seed: int = 0

    def deadline_s(self, attempt: int) -> float:
        """Seconds of training into ``attempt`` at which it fails."""
        return random.Random(f"{self.seed}:{attempt}:time").expovariate(1.0 / self.mtbf_s)

    def victim(self, attempt: int, world_size: int) -> int:
        return random.Random(f"{self.seed}:{attempt}:rank").randrange(max(world_size, 1))


def random_failures_from_env() -> RandomFailures | None:
    value = os.environ.get(ENV_FAULT_MTBF, "").strip()
    if not value:
        return None
    parts = value.split(":")
    try:
        mtbf, seed = float(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        mtbf, seed = -1.0, 0
    if len(parts) > 2 or not mtbf > 0:
        raise ValueError(f"{ENV_FAULT_MTBF}={value!r}: expected SECONDS[:SEED] (a mean time between failures > 0 "
                         "and an integer seed), e.g. '60:7'.")
    return RandomFailures(mtbf, seed)


def maybe_fail_randomly(failures: RandomFailures, rank: int, world_size: int, attempt: int, training_s: float) -> None:
    """SIGKILL this process if it is this attempt's victim and its failure time (in training seconds) has come."""
    if rank == failures.victim(attempt, world_size) and training_s >= failures.deadline_s(attempt):
        print(f"lightning-ett fault injection: SIGKILL rank {rank} after {training_s:.1f}s of training in attempt {attempt} "
              f"(failure rate: MTBF {failures.mtbf_s:g}s)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
