"""Which rank makes the others wait, and for how long per batch: a diagnosis, not a restart.

Method. Each rank stamps, locally and per training batch, two host times: ``ready`` (the batch has
been fetched; Lightning fetches just before ``on_train_batch_start``; where a strategy reads ahead
inside the step, as ETTStrategy's pipeline does, the end of that read if later:
:mod:`lightning_ett.instrument.step_marks`) and ``forward_done`` (the
first ``on_before_backward`` of the batch; absent under manual optimization). Nothing is sent per
step. Every N batches all ranks all-gather one small float64 row (:meth:`WindowStamps.row`): the
window's stamps, measured from the instant this rank *left the previous gather*, and the instants it
left the last few gathers. Leaving a collective is an instant common to every rank, up to the
collective's exit skew, so those instants give each rank's clock offset: skew between hosts, however
large, cannot move the blame, and the stamps use the monotonic clock, so a wall-clock step (NTP)
cannot either. The offset is the median over the last :data:`OFFSET_GATHERS` gathers, not the last
one alone: on a loaded host a rank may wake from a collective a millisecond late, and one gather's
exit error would shift a whole window (measured: ±1 ms shifts of whole windows with 2 ranks on 2
cores; the median over 5 gathers removes them). Over those few windows the hosts' clocks are
taken to run at one rate: two clocks 10 ppm apart drift 5 x N steps x 10 ppm, 1.25 % of the
default threshold (10 % of a step, N = 25) whatever the step time.
Then, per batch and point, a rank's lateness is its stamp minus the earliest rank's; per batch,
the larger of its two; its score, the median over the window: the seconds per batch the others
waited for it. It is named when that score passes the threshold *and* it was behind the pack (later
than the other ranks' median by over half the threshold) in at least :data:`MIN_BEHIND_SHARE` of the
window's batches: honest jitter makes every rank late by turns. With several such ranks (a slow
node) the worst is named, and the streak goes on while any of them was one the window before.
The first window has no earlier gather to measure from: it only sets the origin
(with :data:`ORIGIN_GATHERS` gathers in a row, so the next window's offsets are a median already).

What it sees:

* ``data`` side: slowness between the previous step's last collective and ``ready``: the data
  fetch (or the pipeline's read-ahead of the next batch), host-side input work (collate,
  ``batch_to_device``), a slow ``on_train_batch_start``.
* ``compute`` side: slowness in the forward after its last collective, up to the backward (a
  slower ``training_step`` on the host).

What it does not see: slowness inside the backward (DDP's gradient all-reduces are collectives:
the ranks leave the backward together, so the lateness is absorbed there; it shows as step-time
deviation, ``ett/step_time_deviation``), nor slowness after a step's last collective and before
the next batch's first one (under DDP Lightning broadcasts a SIGTERM flag at each batch start,
which absorbs it). The stamps are host times with no device sync: on GPUs, a rank whose *device*
is slower than its peers' (its host is not) is not seen either.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_ett.instrument.straggler_facts import WARN_AFTER_WINDOWS

#: The absolute floor of the threshold: below it, lateness is the collectives' own exit skew and noise.
#: Measured on clean 2-rank runs on 2 cores (tests/distributed/test_stragglers.py, 2026-12-04): the highest
#: window 1.3-1.6 ms, and once 2.1 ms in two windows in a row, a false warning under the former 2 ms floor.
MIN_THRESHOLD_S = 0.003
#: The share of a window's batches in which a rank must be behind the pack (later than the other ranks' median by over
#: half the threshold) to be named. A median lateness over the threshold alone named healthy ranks under honest
#: per-batch jitter (a new-user trial: both ranks' reads drawn from one 0-60 ms distribution, 300 steps; a warning in
#: about half of such runs, simulated): every rank is then behind in under half the batches; a straggler, or each rank
#: of a slow node, in nearly all. (Measured against the latest rank instead, a slow node's ranks took turns and none
#: was named.) Simulated (40 windows of 25 batches, 3 seeds, 2/4/8 ranks, 100 ms steps, 10 ms threshold): no warning
#: under uniform 0-60 ms or exponential 10-30 ms jitter on every rank; a rank with an extra Exp(20 ms) per batch named in
#: 24-30 windows and warned about, +15 ms in all 40; a rank stalled in half the batches is not named (see README).
MIN_BEHIND_SHARE = 0.75
#: Gathers whose leave times give each rank's clock offset (their median): one noisy exit cannot shift a window.
OFFSET_GATHERS = 5
#: Gathers in a row at the first window (which only sets the origin), so the first scored window's offsets
#: are already a median of three, not one noisy sample. Once per fit.
ORIGIN_GATHERS = 3
_HEADER = 2  # a row's fields before the leave times: the batch count, and how many leave times it holds


class WindowStamps:
    """One rank's stamps for the current window, kept locally until the next gather."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"WindowStamps(size={size}): a window holds at least one batch.")
        self.size = size
        self.leaves: deque[float] = deque(maxlen=OFFSET_GATHERS)  # when this rank left the last gathers (its clock)
        self._ready = [math.nan] * size
        self._forward = [math.nan] * size
        self.count = 0
        self._forward_open = False

    @property
    def full(self) -> bool:
        """The window holds its N batches: time to gather (the same batch on every rank)."""
        return self.count >= self.size

    def ready(self, t: float) -> None:
        if self.count < self.size:
            self._ready[self.count] = t
            self.count += 1
            self._forward_open = True

    def data_read(self, t: float) -> None:
        """Data work for the current batch ended at ``t`` inside its step (a read-ahead of the next batch, before
        the forward's first collective): ``ready`` is the later of the two."""
        if self.count and self._forward_open:
            self._ready[self.count - 1] = max(self._ready[self.count - 1], t)

    def forward_done(self, t: float) -> None:
        """The first backward of the current batch begins (later calls of the same batch are ignored)."""
        if self._forward_open:
            self._forward[self.count - 1] = t
            self._forward_open = False

    def row(self) -> list[float]:
        """``[count, n, leave times (nan-padded, oldest first), ready x N, forward x N]``.

        Stamps are measured from the last leave time; leave times are this rank's clock (float64 keeps them
        to well under a microsecond).
        """
        origin = self.leaves[-1] if self.leaves else 0.0
        leaves = [math.nan] * (OFFSET_GATHERS - len(self.leaves)) + list(self.leaves)
        stamps = [t - origin for t in self._ready] + [t - origin for t in self._forward]
        return [float(self.count), float(len(self.leaves)), *leaves, *stamps]

    def left(self, t: float) -> None:
        """This rank left another gather at ``t`` (its clock): one more sample for the offsets."""
        self.leaves.append(t)

    def restart(self, left: float) -> None:
        """A gather just ended at ``left`` (this rank's clock): the next window is measured from it."""
        self.left(left)
        self._ready = [math.nan] * self.size
        self._forward = [math.nan] * self.size
        self.count = 0
        self._forward_open = False


@dataclass(frozen=True)
class WindowScores:
    """Per-rank lateness over one window, in seconds per batch (a micro-batch under gradient accumulation)."""

    scores: tuple[float, ...]  # median over the window of max(ready, forward) lateness
    data_scores: tuple[float, ...]  # the same at ``ready`` alone: how much of it is the data side
    batches: int
    step_s: float  # median step period of the earliest rank (nan with one batch)
    lateness: Any = None  # per rank and batch, max(ready, forward) lateness (ranks x batches; nan: a missing stamp)

    def behind_shares(self, margin: float) -> tuple[float, ...]:
        """Per rank, the share of the batches (stamped by every rank) in which it was more than ``margin`` later
        than the other ranks' median: behind the pack. Honest jitter puts every rank behind in under half the
        batches; a straggler, or each rank of a slow node (fewer than half the ranks), in nearly all. The *other*
        ranks' median: with 2 ranks that is the other rank, so ``margin`` means the same at every world size (the
        median of all ranks halves a lone straggler's lead at 2). Empty without ``lateness``."""
        if self.lateness is None:
            return ()
        late = np.asarray(self.lateness)
        scored = late[:, ~np.isnan(late).any(axis=0)]
        if scored.shape[1] == 0:
            return tuple(0.0 for _ in range(late.shape[0]))
        behind = scored - others_median(scored) > margin
        return tuple(float(share) for share in behind.mean(axis=1))

    def side(self, rank: int) -> str:
        """``data`` when the rank is already late at ``ready``, else ``compute`` (late only after the forward)."""
        return "data" if self.data_scores[rank] >= 0.5 * self.scores[rank] else "compute"


def window_scores(rows: Any) -> WindowScores | None:
    """Score one window from the gathered rows (one per rank, :meth:`WindowStamps.row`).

    ``None`` for a window with nothing to score: no origin yet (the first window), no batch, one rank.
    """
    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[0] < 2:
        return None
    count, gathers = int(rows[:, 0].min()), int(rows[:, 1].min())
    if count < 1 or gathers < 1:
        return None
    shift = _origin_errors(rows[:, _HEADER:_HEADER + OFFSET_GATHERS][:, OFFSET_GATHERS - gathers:])
    first = _HEADER + OFFSET_GATHERS
    size = (rows.shape[1] - first) // 2
    ready = rows[:, first:first + count] + shift[:, None]
    forward = rows[:, first + size:first + size + count] + shift[:, None]
    earliest = ready.min(axis=0)  # nan where a rank missed a stamp: that batch then scores nothing at `ready`
    late_ready = ready - earliest
    with np.errstate(invalid="ignore"):
        late_forward = forward - forward.min(axis=0)  # all-nan without forward stamps (manual optimization)
    late = np.fmax(late_ready, late_forward)  # fmax: a missing point leaves the other
    scores = _row_medians(late)
    data_scores = _row_medians(late_ready)
    step_s = float(_row_medians(np.diff(earliest)[None, :])[0]) if count >= 2 else math.nan
    clean = tuple(float(s) if math.isfinite(s) else 0.0 for s in scores)
    return WindowScores(clean, tuple(float(s) if math.isfinite(s) else 0.0 for s in data_scores), count, step_s, late)


def others_median(values: np.ndarray) -> np.ndarray:
    """``[r, b]``: the median of column ``b`` without row ``r`` (rows: ranks, at least 2). One sort per column, then
    index arithmetic: O(ranks log ranks) per batch, where deleting each row in turn would be quadratic in ranks."""
    n, batches = values.shape
    order = np.argsort(values, axis=0, kind="stable")
    ordered = np.take_along_axis(values, order, axis=0)
    position = np.empty_like(order)  # each value's place in its sorted column
    np.put_along_axis(position, order, np.broadcast_to(np.arange(n)[:, None], (n, batches)), axis=0)

    def of_the_others(i: int) -> np.ndarray:  # the i-th smallest once this row's own value is taken out
        return np.take_along_axis(ordered, np.where(i < position, i, i + 1), axis=0)

    left = n - 1
    return (of_the_others((left - 1) // 2) + of_the_others(left // 2)) / 2


def _row_medians(values: np.ndarray) -> np.ndarray:
    """Each row's median over its non-nan entries; nan for a row with none (no forward stamps, manual optimization).

    Not ``np.nanmedian``: it warns on an all-nan row, and silencing that with ``warnings.catch_warnings``
    resets Python's show-once registry, so every warning the process showed once is printed again."""
    medians = np.full(values.shape[0], math.nan)
    for i, row in enumerate(values):
        finite = row[~np.isnan(row)]
        if finite.size:
            medians[i] = np.median(finite)
    return medians


def _origin_errors(leaves: np.ndarray) -> np.ndarray:
    """How far each rank's last leave time (its stamps' origin) sits from the common instant, on one scale.

    ``leaves[r, k]``: when rank r left gather k, on its own clock. ``leaves[r, k] - leaves[0, k]`` is
    rank r's clock offset plus gather k's exit noise; its median over the gathers is the offset alone.
    What the last gather's difference has beyond it is that gather's exit error: add it back.
    """
    differences = leaves - leaves[0]
    return differences[:, -1] - np.median(differences, axis=1)


def threshold_s(fraction: float, step_s: float | None, floor: float = MIN_THRESHOLD_S) -> float:
    """The lateness that names a straggler: ``fraction`` of the step time, never under ``floor``."""
    if step_s is None or not math.isfinite(step_s) or step_s <= 0:
        return floor
    return max(floor, fraction * step_s)


@dataclass(frozen=True)
class Verdict:
    """One window's diagnosis."""

    window: WindowScores
    straggler: int | None
    threshold_s: float
    step_s: float | None  # the step time the threshold was a fraction of
    streak: int  # consecutive windows (this one included) naming this straggler
    warn: bool  # the streak just reached WARN_AFTER_WINDOWS
    behind_shares: tuple[float, ...] = ()  # per rank: the share of batches it was behind the pack

    @property
    def score_s(self) -> float:
        return self.window.scores[self.straggler] if self.straggler is not None else max(self.window.scores)

    @property
    def side(self) -> str | None:
        return self.window.side(self.straggler) if self.straggler is not None else None

    def fact(self) -> dict[str, Any]:
        """The fields of the ledger fact (``Timeline.fact("straggler", ...)``) the summary and report read."""
        return {
            "straggler": self.straggler,
            "score_s": round(self.score_s, 6),
            "side": self.side,
            "scores": [round(s, 5) for s in self.window.scores],
            "behind_share": [round(s, 3) for s in self.behind_shares],
            "batches": self.window.batches,
            "threshold_s": round(self.threshold_s, 6),
            "step_s": round(self.step_s, 6) if self.step_s is not None and math.isfinite(self.step_s) else None,
            "streak": self.streak,
            "warned": self.warn,  # the live warning named this straggler here: the report names it too
        }

    def message(self) -> str:
        assert self.straggler is not None
        return (f"ETTMonitor: rank {self.straggler} is a straggler: the other ranks waited for it "
                f"{1000 * self.score_s:.1f} ms per batch ({self.side} side) for {self.streak} consecutive windows of "
                f"{self.window.batches} batches (threshold {1000 * self.threshold_s:.1f} ms). See the `stragglers` entry "
                "of ett_summary.json.")


class StragglerTracker:
    """Turns window scores into verdicts, and says when to warn (the same rank named in consecutive windows)."""

    def __init__(self, fraction: float, floor: float = MIN_THRESHOLD_S, warn_after: int = WARN_AFTER_WINDOWS) -> None:
        self.fraction = fraction
        self.floor = floor
        self.warn_after = warn_after
        self.windows = 0
        self.named: Counter[int] = Counter()  # windows each rank was named in
        self.latest: Verdict | None = None
        self._streak: tuple[set[int], int] = (set(), 0)  # the last window's candidates, and the streak

    def observe(self, window: WindowScores, ideal_step_s: float | None = None) -> Verdict:
        """Judge one window. ``ideal_step_s`` (the job's ideal step) sets the threshold, else the window's step period."""
        step_s = ideal_step_s if ideal_step_s is not None and ideal_step_s > 0 else window.step_s
        limit = threshold_s(self.fraction, step_s, self.floor)
        shares = window.behind_shares(margin=limit / 2)
        candidates = {rank for rank, score in enumerate(window.scores)
                      if score > limit and (not shares or shares[rank] >= MIN_BEHIND_SHARE)}
        straggler = max(candidates, key=window.scores.__getitem__) if candidates else None
        previous, streak = self._streak  # (the ranks of a slow node take turns being the worst: one streak, and a
        # straggler that goes on while a worse one appears beside it goes on too)
        streak = streak + 1 if candidates & previous else (1 if straggler is not None else 0)
        self._streak = (candidates, streak)
        self.windows += 1
        if straggler is not None:
            self.named[straggler] += 1
        self.latest = Verdict(window, straggler, limit, step_s if step_s is not None and math.isfinite(step_s) else None,
                              streak, streak == self.warn_after, shares)
        return self.latest
