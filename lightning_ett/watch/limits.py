"""How long a job may go without progress in each phase: generous until a phase has been seen, then learned.

The way NVIDIA's resiliency extension (NVRx) sets its hang timeouts: until a phase has been
observed a few times its limit is a generous default (nothing is known about this job yet), and
from then on it is a safety factor times the *longest* time observed — not the median: a
phase that is sometimes slow (a checkpoint save behind a busy filesystem, an epoch whose loader
starts cold) must not look hung the first time it is slow again. Observations come from every
rank's ledger, earlier attempts included, so a restart does not forget what the job taught.

One exception: a phase that outlasted its limit while some rank was visibly working (the watch
cleared that silence on evidence of work) is not learned. The evidence, not a longer limit, let
that work through; learning it would make a job with a 40 s rank-zero evaluation wait 200 s
before calling any later training step hung.

A phase is one of the ledger's phases (:class:`~lightning_ett.instrument.timeline.Phase`) that a
rank announces with a ``begin`` record. The start-up phases (process group, model build, logger
start, ...) share one limit, ``startup``, which also applies before a rank's first steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lightning_ett.instrument.ledger import RankLedger
from lightning_ett.instrument.timeline import Phase

STARTUP = "startup"
TRAIN = Phase.TRAIN.value
SHUTDOWN = Phase.SHUTDOWN.value
#: Phases with a limit of their own; every other announced phase is part of ``startup``.
OWN_LIMIT = (Phase.TRAIN.value, Phase.COMPILE.value, Phase.CHECKPOINT_LOAD.value, Phase.CHECKPOINT_SAVE.value,
             Phase.EVAL.value, Phase.DATA_INIT.value, Phase.PUBLISH.value, Phase.SHUTDOWN.value)


_COUNTS = ("min_observations", "warmup_steps")


def limit_key(phase: str) -> str:
    """The limit a rank in ``phase`` gets: its own, or ``startup``."""
    return phase if phase in OWN_LIMIT else STARTUP


@dataclass(frozen=True)
class HangTimeouts:
    """Limits on silence per phase (``lightning run --hang-timeout PHASE=S`` and the learning rule).

    The values are the generous defaults that apply until a phase has been seen ``min_observations``
    times: 10 minutes (NCCL's own default timeout), 30 minutes (Lightning's) for the two phases that
    legitimately run long on one rank while the others wait for it, compilation and evaluation. They
    bound a hang only before its phase was ever seen; slow work is let through by the evidence of
    work, not by them. A phase named in ``fixed`` keeps its value
    and is never learned: that is what ``--hang-timeout PHASE=S`` does. A learned limit is
    ``safety_factor`` x the longest observation, never under ``min_limit``: a floor above ordinary jitter
    (a garbage collection, a batch read from a cold page cache, a scheduling hiccup on a loaded host:
    seconds), for a fast step's 5x would be a fraction of a second. What lets longer slow work through
    is the evidence of work the watch checks before it acts, not this floor. Training steps are
    learned from a rank's ``warmup_steps``-th step of an attempt on (the first steps build kernels
    and warm caches, and a compilation in them is a phase of its own).
    """

    startup: float = 600.0
    train: float = 600.0
    compile: float = 1800.0
    checkpoint_load: float = 600.0
    checkpoint_save: float = 600.0
    eval: float = 1800.0
    data_init: float = 600.0
    publish: float = 600.0
    shutdown: float = 600.0
    safety_factor: float = 5.0
    min_limit: float = 10.0
    min_observations: int = 3
    warmup_steps: int = 5
    fixed: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "fixed":
                continue
            value = getattr(self, f.name)
            low_ok = f.name == "warmup_steps" and value == 0  # no warm-up: steps are learned from the first
            if not low_ok and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                unit = "a factor" if f.name == "safety_factor" else "a count" if f.name in _COUNTS else "seconds"
                raise ValueError(f"hang timeout {f.name}={value!r}: expected a number > 0 ({unit}).")
        unknown = set(self.fixed) - set(self.phases())
        if unknown:
            raise ValueError(f"hang timeouts fixed for unknown phase(s) {sorted(unknown)}; expected some of {self.phases()}.")

    @classmethod
    def phases(cls) -> tuple[str, ...]:
        """The names ``--hang-timeout PHASE=SECONDS`` accepts."""
        return (STARTUP, *OWN_LIMIT)

    def with_fixed(self, **seconds: float) -> HangTimeouts:
        """These phases' limits set by the user: fixed, never learned."""
        return replace(self, **seconds, fixed=self.fixed | frozenset(seconds))

    def default(self, key: str) -> float:
        """``key``'s limit before it is learned (or as fixed by ``--hang-timeout``)."""
        return float(getattr(self, key))

    def busy_ceiling(self, key: str) -> float:
        """How long CPU time or I/O alone may explain a silence in ``key``: its unlearned default (or its fixed limit,
        if longer). Past it a rank must also move its stack: a livelocked or spinning rank burns CPU forever."""
        return max(float(getattr(self, key)), float(_FIELD_DEFAULTS[key]))

    def longest_default(self) -> float:
        """The longest unlearned default of any phase: how long a node that holds none of a stall's cause waits."""
        return max(max(float(getattr(self, k)), float(_FIELD_DEFAULTS[k])) for k in self.phases())


@dataclass
class _Seen:
    count: int = 0
    longest: float = 0.0


_FIELD_DEFAULTS = {f.name: f.default for f in fields(HangTimeouts) if f.name in HangTimeouts.phases()}


class PhaseHistory:
    """The longest time each phase took so far in this job, and how often it was seen (the learning input).

    A phase in which the watch stopped the job gets its generous default back for the rest of the job
    (:meth:`escalate`): had the verdict been wrong — an idle wait the job does now and then, which looks
    exactly like a hang — the same wait after the restart must not be stopped again. A false verdict then
    costs a healthy job one restart, never a loop of them that ends at ``--max-restarts``.
    """

    def __init__(self, timeouts: HangTimeouts) -> None:
        self.timeouts = timeouts
        self._seen: dict[str, _Seen] = {}
        self._escalated: set[str] = set()

    def escalate(self, key: str) -> None:
        """The watch stopped the job in ``key``: from now on its limit is at least its unlearned default."""
        self._escalated.add(key)

    def observe(self, key: str, seconds: float) -> None:
        seen = self._seen.setdefault(key, _Seen())
        seen.count += 1
        seen.longest = max(seen.longest, seconds)

    def observe_event(self, phase: str, seconds: float, steps_before: int, since_attempt_start: float | None) -> None:
        """One finished phase of a rank: ``steps_before`` training steps of its attempt came before it.

        A rank's first step also says how long its start-up took (``since_attempt_start``: from the attempt's
        start to that step's start).
        """
        if phase == TRAIN:
            if steps_before == 0 and since_attempt_start is not None:
                self.observe(STARTUP, since_attempt_start)
            if steps_before >= self.timeouts.warmup_steps:
                self.observe(TRAIN, seconds)
        elif phase in OWN_LIMIT:
            self.observe(phase, seconds)

    def observe_ledgers(self, ledgers: list[RankLedger], explained: Sequence[float] = ()) -> None:
        """Learn from earlier attempts' ledgers (every rank's): what a restart must not forget.

        ``explained``: the start of each silence that outlasted its limit while a rank was working (the watch's
        ``suspicion`` records). A phase that contains one is not learned: evidence of work, not a longer limit,
        let it through, and learning it would make every later hang in that phase wait as long.
        """
        for ledger in ledgers:
            attempt_start = ledger.header.get("attempt_start")
            steps = 0
            for event in _outermost(ledger.events):
                start, end, phase = float(event["start"]), float(event["end"]), str(event["phase"])
                since = start - attempt_start if isinstance(attempt_start, (int, float)) else None
                if not any(start <= t <= end for t in explained):
                    self.observe_event(phase, end - start, steps, since)
                steps += phase == TRAIN

    def limit(self, key: str) -> float:
        """Seconds of silence ``key`` allows now (see :class:`HangTimeouts`)."""
        t = self.timeouts
        seen = self._seen.get(key)
        if key in t.fixed or seen is None or seen.count < t.min_observations:
            return t.default(key)
        learned = max(t.min_limit, t.safety_factor * seen.longest)
        return max(learned, t.default(key)) if key in self._escalated else learned

    def learned(self) -> dict[str, Any]:
        """What was learned, for the verdict: ``key -> (count, longest, limit)``."""
        return {k: {"seen": s.count, "longest_s": round(s.longest, 3), "limit_s": round(self.limit(k), 3),
                    "escalated": k in self._escalated} for k, s in sorted(self._seen.items())}


def _outermost(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events by end time, without those inside another event of the same phase (one occurrence, recorded twice)."""
    ordered = sorted(events, key=lambda e: (float(e["start"]), -float(e["end"])))
    kept: list[dict[str, Any]] = []
    open_until: dict[str, float] = {}
    for event in ordered:
        phase, end = str(event["phase"]), float(event["end"])
        if end <= open_until.get(phase, float("-inf")):
            continue
        open_until[phase] = end
        kept.append(event)
    return sorted(kept, key=lambda e: float(e["end"]))
