"""When a silent rank counts as hung, and which rank to blame: pure decisions over :class:`RankProgress`.

A rank is hung when it is alive and has not moved for longer than its current phase allows
(:class:`HangTimeouts`). Training steps get a multiple of the rank's own median step time,
with a floor; the phases that are slow by nature (compile, checkpoint load and save, evaluation,
a data loader's start) and the start-up before the first steps get generous fixed limits.

The root cause is named from evidence, strongest first:

1. **Progress.** Ranks of one job move in lockstep, so a rank that is behind the others (an
   earlier step, or fewer phases begun since the same step: a checkpoint save its peers
   started) stopped first: the others went on until their next collective waited for it.
   Counts, not clocks, decide this, so clock skew between hosts cannot shift the blame.
2. **Stacks.** When every rank stopped at the same step, the rank that is not inside a
   collective (per its stack dump) is the one the others wait for.
3. Otherwise the rank that went silent first is named, and the verdict says it is ambiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from lightning_ett.watch.progress import STARTUP, TRAIN, RankProgress
from lightning_ett.watch.stacks import StackDump


@dataclass(frozen=True)
class HangTimeouts:
    """Seconds of silence after which a rank counts as hung, per phase (``lightning run --hang-timeout PHASE=S``).

    ``train`` is a floor: a training step may take ``step_factor`` times the rank's median step
    time, or twice its slowest step since warm-up (so a periodically slow step, once seen, is no
    hang), before it counts as hung, but never less than ``train`` seconds. Before ``min_steps``
    steps were measured ``startup`` applies: the first steps build kernels, warm caches and
    connect peers.
    """

    startup: float = 900.0
    train: float = 15.0
    compile: float = 1800.0
    checkpoint_load: float = 900.0
    checkpoint_save: float = 900.0
    eval: float = 1800.0
    data_init: float = 900.0
    shutdown: float = 600.0
    step_factor: float = 10.0
    min_steps: int = 5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"hang timeout {f.name}={value!r}: expected a number > 0 (seconds"
                                 f"{'' if f.name not in ('step_factor', 'min_steps') else ', or a count'}).")

    @classmethod
    def phases(cls) -> tuple[str, ...]:
        """The names ``--hang-timeout PHASE=SECONDS`` accepts."""
        return tuple(f.name for f in fields(cls) if f.name not in ("step_factor", "min_steps"))

    def limit(self, progress: RankProgress) -> float:
        """How long ``progress``'s rank may stay silent in the phase it is in now."""
        phase = progress.phase
        if phase == TRAIN:
            median = progress.median_step_s()
            if progress.trained_steps < self.min_steps or median is None:
                return self.startup
            slowest = progress.slowest_step_s(self.min_steps) or 0.0
            return max(self.step_factor * median, 2.0 * slowest, self.train)
        return float(getattr(self, phase if phase != STARTUP else "startup", self.startup))


@dataclass(frozen=True)
class Stall:
    """A rank silent for longer than its limit."""

    rank: int
    phase: str
    silent_s: float
    limit_s: float


def find_stall(ranks: dict[int, RankProgress], timeouts: HangTimeouts, now: float) -> Stall | None:
    """The rank that has been silent longest beyond its limit, if any."""
    worst: Stall | None = None
    for rank, progress in ranks.items():
        silent, limit = now - progress.last_progress, timeouts.limit(progress)
        if silent > limit and (worst is None or silent - limit > worst.silent_s - worst.limit_s):
            worst = Stall(rank, progress.phase, silent, limit)
    return worst


@dataclass(frozen=True)
class Blame:
    rank: int
    evidence: str
    ambiguous: bool


def blame(ranks: dict[int, RankProgress], stacks: dict[int, StackDump | None]) -> Blame:
    """Name the rank the others wait for (see the module docstring for the order of evidence)."""
    positions = {rank: p.position for rank, p in ranks.items()}
    behind = [r for r, pos in positions.items() if pos == min(positions.values())]
    if len(behind) < len(ranks):
        ahead = sorted(set(ranks) - set(behind))
        got = _where(ranks[behind[0]])
        if len(behind) == 1:
            lead = ranks[ahead[0]]
            return Blame(behind[0], f"it stopped {got} while rank(s) {_list(ahead)} went on "
                                    f"({_where(lead)}, in {lead.phase})", False)
        outside = [r for r in behind if stacks.get(r) is not None and not stacks[r].in_collective]  # type: ignore[union-attr]
        if len(outside) == 1:
            return Blame(outside[0], f"ranks {_list(behind)} stopped {got}; of them only rank {outside[0]} "
                                     "is not inside a collective", False)
        first = min(behind, key=lambda r: ranks[r].last_progress)
        return Blame(first, f"ambiguous: ranks {_list(behind)} all stopped {got}; rank {first} went silent first",
                     True)
    dumped = {r: s for r, s in stacks.items() if s is not None and r in ranks}
    outside = sorted(r for r, s in dumped.items() if not s.in_collective)
    inside = sorted(r for r, s in dumped.items() if s.in_collective)
    if inside and len(outside) == 1:
        return Blame(outside[0], f"every rank stopped {_where(ranks[outside[0]])}; rank {outside[0]} is the only one "
                                 f"not inside a collective (rank(s) {_list(inside)} wait in one)", False)
    if len(ranks) == 1 and outside:  # this node's only rank waits for no one: it hung by itself
        return Blame(outside[0], f"it stopped {_where(ranks[outside[0]])}, outside any collective", False)
    first = min(ranks, key=lambda r: (ranks[r].last_progress, r))
    if inside and not outside:
        why = "every rank of this node waits inside a collective: the rank holding them up is probably on another node"
    elif len(outside) > 1:
        why = f"ranks {_list(outside)} are all outside collectives"
    else:
        why = "no stack dumps to tell the ranks apart"
    return Blame(first, f"ambiguous: every rank stopped {_where(ranks[first])}; {why}; rank {first} went silent first",
                 True)


def _where(progress: RankProgress) -> str:
    step = progress.current_step
    if step is None:
        return "before its first step"
    return f"before step {step}" if progress.position[1] else f"in step {step}"


def _list(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))
