"""Whether an incremental chain's next save is a delta or full, by the measured cost of each.

Why: a delta is worth writing only while it costs less than a full save. On a heavy-tailed id
stream an interval touches few rows, and a delta costs a fraction of a full save (Zipf 1.05 on
the reference job: 0.6-0.9 s of true cost, where steady full saves cost 1-4 s and a fit's first,
which allocates the staging buffers, 5-9 s). On a uniform stream over an interval long enough to
touch most rows it can cost as much (every row is compared, the changed ones gathered, then
nearly all written anyway), and each delta lengthens the chain a restore reads. A full save's
reference cost is the median of its last few *typical* ones: not a fit's first, nor a delta the
writer turned full. So the chain continues while the last delta's true cost (blocked + slowdown, as
the cadence measures it) stays under :data:`DELTA_COST_RATIO` of a full save's (the median of
the last few); once two deltas in a row cost more, the next saves are full. Which kind pays can change as training goes (the
rows an interval touches change with the data and the cadence), so a delta is tried again
after 2 full saves, then 4, 8, up to :data:`MAX_FULL_RUN` while deltas keep losing. A first delta
whose rows alone outgrow the chain's restore bound (the writer then writes the save full, after
comparing every row for nothing) loses the same way.

The chain's restore time is bounded separately (``chain.next_delta_budget``); ``full_every_n_saves``
overrides both. Hand-written: Check-N-Run's policy is described, not shipped, and TorchRec's
model tracker tracks rows, not what saving them costs.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from lightning_ett.checkpoint.chain import MAX_EXTRA_RESTORE

#: A delta must cost under this share of a full save to continue the chain: within 20 % the delta buys
#: little and still lengthens the chain a restore reads (and one noisy reading must not decide it).
DELTA_COST_RATIO = 0.8
#: Most full saves in a row before a delta is tried again.
MAX_FULL_RUN = 16
_FULL_WINDOW = 3
_LOSING_TO_BACK_OFF = 2  # deltas in a row that must lose before the first back-off


class SaveKindChooser:
    """Rank 0's record of what each kind of save cost, and the choice it implies."""

    def __init__(self) -> None:
        self._full_costs: deque[float] = deque(maxlen=_FULL_WINDOW)
        self._full_run = 1  # full saves to write after the next losing delta (doubles while deltas lose)
        self._fulls_to_go = 0  # full saves still to write before a delta is tried again
        self._losing = 0  # deltas in a row that cost too much (reset by one that pays)

    def observe(self, incremental: bool, cost_s: float, outgrew_bound: bool = False, typical: bool = True) -> str | None:
        """Record a committed save's true cost; returns a sentence when deltas just stopped paying.

        ``outgrew_bound``: the save was staged as the first delta of a chain and written full, its rows
        alone over the chain's restore bound. It lost like a costly delta (its rows were compared for
        nothing). ``typical=False``: a full save whose cost is no full save's — a fit's first (it
        allocates the staging buffers: 5-9 s where later ones cost 1-4 s on the benchmark's job) or a
        delta the writer turned full (a comparison for nothing on top).
        """
        if outgrew_bound:
            self._fulls_to_go = self._back_off()
            return ("the rows changed since the last save alone outgrew the chain's restore bound (a chain is kept "
                    f"to what restores in {1 + MAX_EXTRA_RESTORE:.1f} full restores: its deltas' bytes plus a fixed "
                    f"cost per delta and rank), so the next {self._fulls_to_go} saves are full without comparing rows, "
                    "then a delta is tried again")
        if not incremental:
            if typical:
                self._full_costs.append(max(cost_s, 0.0))
            self._fulls_to_go = max(self._fulls_to_go - 1, 0)
            return None
        delta_cost = max(cost_s, 0.0)
        full = self.full_cost_s
        if full is None or delta_cost < DELTA_COST_RATIO * full:
            self._full_run, self._losing = 1, 0
            return None
        self._losing += 1
        if self._losing < _LOSING_TO_BACK_OFF:
            return None  # one reading is no verdict (a straggler, a pause): the next delta decides
        self._fulls_to_go = self._back_off()
        return (f"the last delta cost {delta_cost:.2f} s (blocked + slowdown), a full save "
                f"{full:.2f} s: deltas pay only under {DELTA_COST_RATIO:.0%} of a full save here, so the next "
                f"{self._fulls_to_go} saves are full, then a delta is tried again")

    def _back_off(self) -> int:
        """Deltas lost: how many full saves come before the next try (twice as many as last time)."""
        self._full_run = min(2 * self._full_run, MAX_FULL_RUN)
        return self._full_run

    @property
    def full_cost_s(self) -> float | None:
        return statistics.median(self._full_costs) if self._full_costs else None

    def delta_pays(self) -> bool:
        """May the next save be a delta, as far as cost goes (until measured: yes, to measure it)?"""
        return self._fulls_to_go == 0

    def state_dict(self) -> dict[str, Any]:
        return {"full_costs": list(self._full_costs), "full_run": self._full_run,
                "fulls_to_go": self._fulls_to_go, "losing": self._losing}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._full_costs.clear()
        self._full_costs.extend(float(c) for c in state.get("full_costs", []))
        self._full_run = max(int(state.get("full_run", 1)), 1)
        self._fulls_to_go = max(int(state.get("fulls_to_go", 0)), 0)
        self._losing = max(int(state.get("losing", 0)), 0)


__all__ = ["DELTA_COST_RATIO", "MAX_FULL_RUN", "SaveKindChooser"]
