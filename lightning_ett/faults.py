"""Fault injection for tests and benchmarks: kill a chosen rank at a chosen step of an attempt.

``LIGHTNING_ETT_FAULT_KILL="RANK:STEP[:ATTEMPT][,...]"`` makes :class:`~lightning_ett.ETTMonitor`
SIGKILL global rank ``RANK`` right after optimizer step ``STEP`` (``trainer.global_step``)
finished, in attempt ``ATTEMPT`` of the job (default 0), so the restart path runs exactly as
after a real crash: no handler, no flush, no goodbye. ``"1:40"`` kills rank 1 at step 40 of
the first attempt; ``"1:40,0:90:1"`` also kills rank 0 at step 90 of the second.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

ENV_FAULT_KILL = "LIGHTNING_ETT_FAULT_KILL"


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
