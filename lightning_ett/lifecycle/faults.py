"""Fault injection for tests and benchmarks: kill, hang or slow a chosen rank.

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

``LIGHTNING_ETT_FAULT_HANG="RANK:STEP[:ATTEMPT][,...]"`` makes that rank block forever in Python
(:func:`hang_in_python`) right after step ``STEP``, as a deadlocked data loader or a dead mount would:
alive, silent, holding its peers in their next collective. Only ``lightning run``'s hang watch ends it.

``LIGHTNING_ETT_FAULT_HANG_COLLECTIVE="RANK:STEP[:ATTEMPT][,...]"`` makes that rank block in a collective
that no other rank joins (:func:`hang_in_collective`, on a side group every rank made at setup), while
the others go on to their next training collective and wait there for it.

``LIGHTNING_ETT_FAULT_SLOW="RANK:SECONDS[:data|compute]"`` slows one rank down on every step: by
``SECONDS`` in its data fetch (default) or in its compute (after ``training_step``, before backward).
A straggler to diagnose, not a failure.

A malformed value fails when ``ETTMonitor`` is constructed, before the job trains, naming the variable.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

#: What every injected fault prints first: the launcher quotes the line in the failure reason, so a
#: report (and a benchmark) can tell an injected failure from a real one.
FAULT_INJECTION = "lightning-ett fault injection"

ENV_FAULT_KILL = "LIGHTNING_ETT_FAULT_KILL"
ENV_FAULT_MTBF = "LIGHTNING_ETT_FAULT_MTBF_S"
ENV_FAULT_HANG = "LIGHTNING_ETT_FAULT_HANG"
ENV_FAULT_HANG_COLLECTIVE = "LIGHTNING_ETT_FAULT_HANG_COLLECTIVE"
ENV_FAULT_SLOW = "LIGHTNING_ETT_FAULT_SLOW"


@dataclass(frozen=True)
class KillFault:
    rank: int
    step: int
    attempt: int = 0


def parse_kill_faults(value: str | None, variable: str = ENV_FAULT_KILL, verb: str = "SIGKILL") -> tuple[KillFault, ...]:
    """Parse a ``RANK:STEP[:ATTEMPT]`` switch; a malformed one is an error naming the variable and the format."""
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
                f"{variable}={value!r}: expected RANK:STEP[:ATTEMPT] (non-negative integers), comma-separated, "
                f"e.g. '1:40' to {verb} rank 1 after step 40 of attempt 0."
            )
        faults.append(KillFault(*numbers))
    return tuple(faults)


def faults_from_env() -> tuple[KillFault, ...]:
    return parse_kill_faults(os.environ.get(ENV_FAULT_KILL))


def _due(faults: tuple[KillFault, ...], rank: int, step: int, attempt: int, began_at: int) -> bool:
    """A fault names this rank and attempt and a step this fit completed (``began_at``: the global step it began or
    resumed at, completed before it): ``global_step`` may pass the step without stopping on it (two optimizers under
    manual optimization advance it by 2); a fit resumed at or past it never completes it."""
    return any(f.rank == rank and f.attempt == attempt and (began_at < f.step or f.step == began_at == 0)
               and f.step <= step for f in faults)  # (step 0: the first batch of a fresh fit, under accumulation)


def maybe_kill(faults: tuple[KillFault, ...], rank: int, step: int, attempt: int, began_at: int = 0) -> None:
    """SIGKILL this process at the first step at or after one a fault names for this rank and attempt."""
    if _due(faults, rank, step, attempt, began_at):
        print(f"{FAULT_INJECTION}: SIGKILL rank {rank} at step {step} of attempt {attempt}",
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
        print(f"{FAULT_INJECTION}: SIGKILL rank {rank} after {training_s:.1f}s of training in attempt {attempt} "
              f"(failure rate: MTBF {failures.mtbf_s:g}s)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class HangFaults:
    """Where ranks hang: in Python, or in a collective no other rank joins."""

    in_python: tuple[KillFault, ...] = ()
    in_collective: tuple[KillFault, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.in_python or self.in_collective)


def hang_faults_from_env() -> HangFaults:
    return HangFaults(
        parse_kill_faults(os.environ.get(ENV_FAULT_HANG), ENV_FAULT_HANG, "hang"),
        parse_kill_faults(os.environ.get(ENV_FAULT_HANG_COLLECTIVE), ENV_FAULT_HANG_COLLECTIVE, "hang"),
    )


def hang_in_python() -> None:
    """Block forever, alive and silent (the frame a stack dump shows for an injected hang)."""
    while True:
        time.sleep(3600)


def hang_in_collective(group: Any) -> None:
    """Block in an all-reduce on ``group`` that no other rank joins (its timeout is made very long)."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1), group=group)
    hang_in_python()  # should the collective ever return, stay hung


def maybe_hang(faults: HangFaults, rank: int, step: int, attempt: int, group: Any = None, began_at: int = 0) -> None:
    """Hang this rank at the first step at or after one a hang fault names for this rank and attempt."""
    where = ("in Python" if _due(faults.in_python, rank, step, attempt, began_at)
             else "in a collective" if _due(faults.in_collective, rank, step, attempt, began_at) else None)
    if where is None:
        return
    print(f"{FAULT_INJECTION}: rank {rank} hangs {where} at step {step} of attempt {attempt} "
          f"(t={time.time():.3f})", file=sys.stderr, flush=True)
    if where == "in Python" or group is None:
        hang_in_python()
    hang_in_collective(group)


def hang_collective_group() -> Any:
    """The side group :func:`hang_in_collective` blocks on; every rank must call this (it is a collective)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timedelta(days=1))


@dataclass(frozen=True)
class SlowFault:
    """One rank slowed by ``seconds`` per step, in its data fetch or its compute."""

    rank: int
    seconds: float
    where: str = "data"


def slow_fault_from_env() -> SlowFault | None:
    value = os.environ.get(ENV_FAULT_SLOW, "").strip()
    if not value:
        return None
    parts = value.split(":")
    try:
        rank, seconds = int(parts[0]), float(parts[1])
    except (ValueError, IndexError):
        rank, seconds = -1, -1.0
    where = parts[2] if len(parts) > 2 else "data"
    if len(parts) not in (2, 3) or rank < 0 or not seconds > 0 or where not in ("data", "compute"):
        raise ValueError(f"{ENV_FAULT_SLOW}={value!r}: expected RANK:SECONDS[:data|compute] (a rank >= 0, seconds > 0), "
                         "e.g. '1:0.05:compute' to slow rank 1's compute by 50 ms per step.")
    return SlowFault(rank, seconds, where)
