"""When a job counts as hung, and which rank to blame: pure decisions over what the watch observed.

**Per job, not per rank.** Ranks of one job wait for each other, so a rank's silence means nothing
alone: it may be waiting in a collective for a peer that does legitimate slow work. The job's
limit is the longest of its ranks' current limits (:mod:`lightning_ett.watch.limits`): while any
rank is inside a phase with a long limit, its peers inherit it. The job is *suspect* once no rank
has written to its ledger for longer than that.

**Hung means not making progress, not quiet.** A suspect job is confirmed over a short window
(:func:`working`): a rank whose ledger moved, whose flight recorder completed a collective, whose
process tree used CPU or I/O (:mod:`lightning_ett.watch.activity`), or whose stack changed between
two dumps, is working, and so the job is not hung: its silent ranks wait for it. On a CUDA rank
CPU time counts only while it has no NCCL collective pending: a rank waiting on NCCL spins at 100 %.
CPU and I/O alone explain a silence only up to the phase's unlearned default: past it a livelocked or
spinning rank would look busy forever, so the stack must move too.

**Blame** names the rank the others wait for, from evidence, strongest first:

1. **The operating system.** A rank that is stopped (process state ``T``: SIGSTOP, a debugger), or
   that gave no stack dump while its peers did, is held where no code of its own can run.
2. **The flight recorder.** A rank that has not enqueued the collective its peers wait for
   (:func:`lightning_ett.watch.flight_recorder.behind`), on gloo and NCCL alike, whatever its host
   step count or its stack show.
3. **Progress.** Ranks of one job move in lockstep, so a rank behind the others (an earlier step,
   or fewer phases begun since the same step) stopped first. Counts, not clocks, decide this.
4. **Stacks.** The only rank neither inside a collective nor in backward (where DDP's and
   TorchRec's collectives wait, in C++), while the others are.
5. Otherwise the rank that went silent first, and the verdict says it is ambiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ett.watch.activity import Activity
from lightning_ett.watch.flight_recorder import Collectives, behind, mismatch
from lightning_ett.watch.limits import SHUTDOWN, STARTUP, TRAIN, PhaseHistory, limit_key
from lightning_ett.watch.progress import RankProgress
from lightning_ett.watch.stacks import StackDump


def rank_limit_key(progress: RankProgress) -> str:
    """Which limit a rank's present state falls under: its innermost announced phase; else ``shutdown`` once ``fit``
    is over, ``train`` once it began a step in this attempt, ``startup`` before."""
    if progress.open_phase is not None:
        return limit_key(progress.open_phase)
    if progress.done:
        return SHUTDOWN
    return TRAIN if progress.position[0] >= 0 else STARTUP


@dataclass(frozen=True)
class Stall:
    """The job went longer than its limit without any rank writing to its ledger."""

    silent_s: float  # since the job's last ledger progress
    since: float  # that progress (wall-clock time): one silence, however often it is looked at
    limit_s: float
    phase: str  # the limit that applied: the longest of the ranks' limits
    limited_by: int  # the rank whose phase set that limit


def find_stall(ranks: dict[int, RankProgress], history: PhaseHistory, now: float) -> Stall | None:
    """The job's stall, if no rank wrote to its ledger for longer than the job's limit (see the module docstring)."""
    if not ranks:
        return None
    keys = {rank: rank_limit_key(p) for rank, p in ranks.items()}
    limited_by = max(ranks, key=lambda r: (history.limit(keys[r]), -r))
    limit = history.limit(keys[limited_by])
    since = max(p.last_progress for p in ranks.values())
    return Stall(now - since, since, limit, keys[limited_by], limited_by) if now - since > limit else None


@dataclass(frozen=True)
class Evidence:
    """What the watch read about one rank at one moment of a confirmation window."""

    last_progress: float  # its ledger's
    collectives: Collectives | None  # its flight recorder (None: no answer)
    stack: StackDump | None = None


def working(before: dict[int, Evidence], after: dict[int, Evidence], activity: dict[int, Activity],
            busy_counts: bool = True) -> dict[int, str]:
    """The ranks that made progress between two readings, each with the evidence that says so.

    CPU time does not count for a rank with a NCCL collective pending: its host spins at 100 % of a core in
    the synchronization that waits for it. ``busy_counts=False`` (a silence past its busy ceiling): CPU and I/O
    count for none, only the ledger, the flight recorder and the stack.
    """
    found: dict[int, str] = {}
    for rank, now in after.items():
        then = before.get(rank)
        if then is None:
            continue
        act = activity.get(rank) if busy_counts else None
        spinning = now.collectives is not None and now.collectives.waiting_on_gpu
        if now.last_progress > then.last_progress:
            found[rank] = "its ledger moved"
        elif now.collectives is not None and then.collectives is not None and now.collectives.completed_since(then.collectives):
            found[rank] = "a collective of it completed"
        elif act is not None and act.busy_cpu and not spinning:
            found[rank] = f"its processes used {act.cpu:.0%} of a core"
        elif act is not None and act.busy_io:
            found[rank] = f"its processes moved {act.io_per_s / 1e6:.1f} MB/s"
        elif now.stack is not None and then.stack is not None and now.stack.main != then.stack.main:
            found[rank] = "its stack changed"
    return found


@dataclass(frozen=True)
class Blame:
    rank: int
    evidence: str
    ambiguous: bool
    source: str  # which evidence named the rank: os, flight_recorder, progress, stacks, first_silent


def blame(ranks: dict[int, RankProgress], stacks: dict[int, StackDump | None],
          collectives: dict[int, Collectives | None] | None = None, states: dict[int, str | None] | None = None,
          num_nodes: int = 1) -> Blame:
    """Name the rank the others wait for (see the module docstring for the order of evidence)."""
    states = states or {}
    stopped = sorted(r for r in ranks if states.get(r) in ("T", "t"))
    if len(stopped) == 1:
        return Blame(stopped[0], f"it is stopped (process state {states[stopped[0]]}: SIGSTOP or a debugger) "
                                 f"{_where(ranks[stopped[0]])}", False, "os")
    answered = [r for r in ranks if stacks.get(r) is not None]
    silent = sorted(r for r in ranks if stacks.get(r) is None)
    if answered and len(silent) == 1:
        return Blame(silent[0], f"it gave no stack dump while rank(s) {_list(sorted(answered))} did (it was "
                                f"{_where(ranks[silent[0]])}): it is held where no signal handler runs", False, "os")
    known = {r: c for r, c in (collectives or {}).items() if c is not None and r in ranks}
    if (named := behind(known)) is not None:
        return Blame(named[0], named[1], False, "flight_recorder")
    if (odd := mismatch(known)) is not None:
        if odd[0] is not None:
            return Blame(odd[0], odd[1], False, "flight_recorder")
        first = min(ranks, key=lambda r: (ranks[r].last_progress, r))
        return Blame(first, f"ambiguous: {odd[1]}; rank {first} went silent first", True, "first_silent")
    positions = {rank: p.position for rank, p in ranks.items()}
    lag = [r for r, pos in positions.items() if pos == min(positions.values())]
    if len(lag) < len(ranks):
        ahead = sorted(set(ranks) - set(lag))
        got = _where(ranks[lag[0]])
        if len(lag) == 1:
            lead = ranks[ahead[0]]
            return Blame(lag[0], f"it stopped {got} while rank(s) {_list(ahead)} went on "
                                 f"({_where(lead)}, {lead.open_phase or 'training'})", False, "progress")
        outside = [r for r in lag if _outside(stacks.get(r))]
        if len(outside) == 1:
            return Blame(outside[0], f"ranks {_list(lag)} stopped {got}; of them only rank {outside[0]} "
                                     "is neither inside a collective nor in backward", False, "stacks")
        first = min(lag, key=lambda r: ranks[r].last_progress)
        return Blame(first, f"ambiguous: ranks {_list(lag)} all stopped {got}; rank {first} went silent first",
                     True, "first_silent")
    dumped = {r: s for r, s in stacks.items() if s is not None and r in ranks}
    outside = sorted(r for r, s in dumped.items() if _outside(s))
    inside = sorted(r for r, s in dumped.items() if not _outside(s))
    if inside and len(outside) == 1:
        return Blame(outside[0], f"every rank stopped {_where(ranks[outside[0]])}; rank {outside[0]} is the only one "
                                 f"neither inside a collective nor in backward (rank(s) {_list(inside)} wait)", False,
                     "stacks")
    if len(ranks) == 1 and outside:  # this node's only rank waits for no one: it hung by itself
        return Blame(outside[0], f"it stopped {_where(ranks[outside[0]])}, outside any collective", False, "stacks")
    first = min(ranks, key=lambda r: (ranks[r].last_progress, r))
    if inside and not outside:
        why = ("every rank of this node waits inside a collective: the rank holding them up is on another node"
               if num_nodes > 1 else "every rank waits inside a collective and none is behind: a collective that "
               "never completes (a network fault, or collectives called in a different order)")
    elif len(outside) > 1:
        why = f"ranks {_list(outside)} are all outside collectives"
    else:
        why = "no stack dumps to tell the ranks apart"
    return Blame(first, f"ambiguous: every rank stopped {_where(ranks[first])}; {why}; rank {first} went silent first",
                 True, "first_silent")


def all_waiting_remotely(ranks: dict[int, RankProgress], stacks: dict[int, StackDump | None],
                         collectives: dict[int, Collectives | None]) -> bool:
    """Every rank of this node waits for a collective and none of them is behind: the cause is on another node."""
    if not ranks:
        return False
    for rank in ranks:
        status, stack = collectives.get(rank), stacks.get(rank)
        waits = (status is not None and status.waiting) or (stack is not None and not _outside(stack))
        if not waits:
            return False
    return behind({r: c for r, c in collectives.items() if c is not None and r in ranks}) is None


def _outside(stack: StackDump | None) -> bool:
    return stack is not None and not stack.in_collective and not stack.in_backward


def _where(progress: RankProgress) -> str:
    step = progress.current_step
    if step is None:
        return "before its first step"
    return f"before step {step}" if progress.position[1] else f"in step {step}"


def _list(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))
