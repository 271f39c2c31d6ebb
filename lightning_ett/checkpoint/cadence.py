"""When to checkpoint: the Young/Daly interval from measured save cost and the failure rate.

A save every ``T`` seconds costs ``C/T`` of the training time (``C``: what one save takes from
training), and each failure throws away on average ``T/2`` of work. Their sum is smallest at
Young's first-order optimum ``T* = sqrt(2·C·MTBF)`` (Daly's higher-order terms matter only
when ``T`` nears the MTBF, where the bounds below take over). Nothing here knows Lightning:
:class:`~lightning_ett.callbacks.checkpoint.AsyncCheckpoint` feeds it step times and save
costs and asks it for the next interval.

The true cost of an asynchronous save is not only the time training is blocked (the
snapshot): training steps also run slower while the background writer takes CPU and memory
bandwidth. ``C = blocked + slowdown``, where the slowdown is the extra time of the steps that
ran while the save was being written, over the median of steps that ran without one (as
``benchmarks/checkpoint_cost.py`` measures it).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

#: Before a job's age is known (no launcher, nothing measured yet), its MTBF is assumed to be this
#: (pass ``mtbf_hours`` to set it).
PRIOR_MTBF_HOURS = 24.0
#: With no failure in a job's first ``W`` seconds, failure rates above ``3/W`` are ruled out at 95 %
#: (the "rule of three"); until the first failure the MTBF is taken as ``W/3``.
RULE_OF_THREE = 3.0
#: In ``"auto"`` mode the first save comes after this many steps: it measures what a save costs.
FIRST_SAVE_STEPS = 20
_STEP_WINDOW = 64  # recent step times the medians use
_COST_WINDOW = 5  # recent save costs; their median is the cost estimate (robust to one slow save, adapts in a few)
_WRITE_MARGIN = 1.25  # saves never come closer than this many write durations (else they would pile up)


@dataclass(frozen=True)
class CadenceDecision:
    """The chosen interval and the numbers it came from (logged, and stated in the ETT report)."""

    interval_steps: int
    interval_s: float
    save_cost_s: float
    mtbf_s: float
    mtbf_source: str
    step_s: float
    bound: str | None  # "min" / "max" when a bound, not the optimum, set the interval

    @property
    def expected_loss_per_failure_s(self) -> float:
        """Work a failure throws away on average: half an interval (failures strike uniformly within it)."""
        return self.interval_s / 2

    @property
    def predicted_overhead(self) -> float:
        """Fraction of training time spent on saves and on lost work: ``C/T + T/(2·MTBF)``."""
        if self.interval_s <= 0:
            return float("nan")
        return self.save_cost_s / self.interval_s + self.interval_s / (2 * self.mtbf_s)

    def to_fields(self) -> dict[str, Any]:
        return {**asdict(self), "expected_loss_per_failure_s": self.expected_loss_per_failure_s,
                "predicted_overhead": self.predicted_overhead}


def estimate_mtbf_s(failures: int, job_age_s: float) -> tuple[float, str]:
    """The job's MTBF as its ledger tells it: ``age / failures``; before the first failure, ``age / 3``.

    Why not a fixed prior until the first failure: a prior far above the true MTBF (a day, for
    a job that fails every few minutes) makes "auto" checkpoint as rarely as its upper bound
    allows, and the first failure throws all of that away (``benchmarks/cadence.py`` measured
    it). ``age / 3`` is the pessimistic end of what the failure-free age allows: a young job
    saves often (its cost is bounded by the shortest interval, 1.25 write durations), an old
    one ever more rarely, and the first failure switches to the observed rate.
    """
    if job_age_s <= 0:
        return 3600 * PRIOR_MTBF_HOURS, "job age unknown: assumed"
    if failures > 0:
        return job_age_s / failures, f"ledger: {failures} failure(s) in {job_age_s / 3600:.2f} h"
    return job_age_s / RULE_OF_THREE, f"no failure in {job_age_s / 3600:.2f} h: assumed age/3"


def young_daly_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Young's optimum checkpoint interval ``sqrt(2·C·MTBF)`` in seconds."""
    if save_cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"young_daly_interval_s(save_cost_s={save_cost_s!r}, mtbf_s={mtbf_s!r}): need C >= 0 and MTBF > 0.")
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


class CadenceTracker:
    """Measures steps and saves; decides the Young/Daly interval in steps.

    Step times: ``wall`` is end-to-end per step (data loading and everything else included),
    which converts seconds into steps; ``compute`` is batch start to batch end, the part a
    background write slows down (validation and logging between steps would otherwise look
    like slowdown).
    """

    def __init__(self, max_interval_s: float) -> None:
        if not max_interval_s > 0:
            raise ValueError(f"CadenceTracker(max_interval_s={max_interval_s!r}): expected a number > 0.")
        self.max_interval_s = float(max_interval_s)
        self._wall: deque[float] = deque(maxlen=_STEP_WINDOW)
        self._quiet_compute: deque[float] = deque(maxlen=_STEP_WINDOW)  # steps with no write in flight
        self._costs: deque[float] = deque(maxlen=_COST_WINDOW)
        self._writes: deque[float] = deque(maxlen=_COST_WINDOW)
        self._provisional = False  # the cost window holds a fit's first save alone (see observe_save)
        self._excess = 0.0  # slowdown accumulated by the steps of the write in flight
        self._carved = 0.0  # how much of it observe_step has reported already

    # ------------------------------------------------------------------ measurements
    def observe_step(self, compute_s: float, wall_s: float | None, writing: bool) -> float:
        """Record a step; returns the part of it to count as the write's cost.

        That is the write's running slowdown (signed sum of the excess of its steps over the
        median step without a write) not returned yet: over a write, the parts add up to its
        net slowdown, so noise does not move time from ``train`` to ``checkpoint_save``.
        """
        if wall_s is not None and wall_s > 0:
            self._wall.append(wall_s)
        if not writing:
            self._quiet_compute.append(compute_s)
            return 0.0
        if not self._quiet_compute:
            return 0.0
        self._excess += compute_s - statistics.median(self._quiet_compute)  # signed: noise cancels over a write
        carve = max(self._excess - self._carved, 0.0)  # what the write has cost so far and was not reported yet
        self._carved += carve
        return carve

    def save_started(self) -> None:
        self._excess = 0.0
        self._carved = 0.0

    def observe_save(self, blocked_s: float, write_s: float, typical: bool = True) -> float:
        """A save became durable; returns its true cost (blocked + slowdown) and keeps it.

        ``typical=False``: a fit's first save, which also allocates the staging buffers (8-14 s where later saves
        cost 1-3 s on ``incremental_auto.py``'s job). That is paid once per fit whatever the interval, so it is no
        part of Young/Daly's per-save ``C``: it is kept only while nothing else is known (a job's first save), and
        the first typical save replaces it. After a restart the restored costs stand.
        """
        cost = max(blocked_s, 0.0) + max(self._excess, 0.0)
        self._excess = self._carved = 0.0
        if typical:
            if self._provisional:
                self._costs.clear()
            self._costs.append(cost)
            self._provisional = False
        elif not self._costs:
            self._costs.append(cost)
            self._provisional = True
        self._writes.append(max(write_s, 0.0))
        return cost

    def inject(self, save_cost_s: float | None = None, step_s: float | None = None, write_s: float | None = None) -> None:
        """Set measurements directly (tests, and restoring state after a restart)."""
        if save_cost_s is not None:
            self._costs.clear()
            self._costs.append(save_cost_s)
            self._provisional = False
        if step_s is not None:
            self._wall.clear()
            self._wall.append(step_s)
        if write_s is not None:
            self._writes.clear()
            self._writes.append(write_s)

    @property
    def save_cost_s(self) -> float | None:
        return statistics.median(self._costs) if self._costs else None

    @property
    def step_s(self) -> float | None:
        return statistics.median(self._wall) if self._wall else None

    @property
    def write_s(self) -> float | None:
        return statistics.median(self._writes) if self._writes else None

    # ------------------------------------------------------------------ decisions
    def decide(self, mtbf_s: float, mtbf_source: str) -> CadenceDecision | None:
        """The interval for now, or ``None`` until a save and a step have been measured."""
        cost, step = self.save_cost_s, self.step_s
        if cost is None or step is None or step <= 0:
            return None
        interval_s = young_daly_interval_s(cost, mtbf_s)
        bound = None
        low = max(step, _WRITE_MARGIN * (self.write_s or 0.0))
        if interval_s > self.max_interval_s:
            interval_s, bound = self.max_interval_s, "max"
        if interval_s < low:
            interval_s, bound = low, "min"
        steps = max(1, round(interval_s / step))
        return CadenceDecision(steps, steps * step, cost, mtbf_s, mtbf_source, step, bound)

    def describe(self, interval_steps: int, mtbf_s: float, mtbf_source: str) -> CadenceDecision | None:
        """The same numbers for a fixed interval (what a failure costs at the user's cadence)."""
        step = self.step_s
        if step is None:
            return None
        return CadenceDecision(interval_steps, interval_steps * step, self.save_cost_s or 0.0, mtbf_s, mtbf_source, step, None)

    # ------------------------------------------------------------------ state (survives restarts)
    def state_dict(self) -> dict[str, Any]:
        return {"costs": list(self._costs), "writes": list(self._writes), "wall": list(self._wall),
                "provisional": self._provisional}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for window in (self._costs, self._writes, self._wall):
            window.clear()
        self._costs.extend(float(c) for c in state.get("costs", []))
        self._writes.extend(float(w) for w in state.get("writes", []))
        self._wall.extend(float(w) for w in state.get("wall", []))
        self._provisional = bool(state.get("provisional", False))
