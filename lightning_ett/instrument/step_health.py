"""Step-time health: the ideal step, how far recent steps stray from it, and ETT% over recent windows.

The job's ETT% is an average since its start: a job that got worse an hour ago still shows its
good past. These say *when* it got worse:

* ``ideal_step_s``: median of recent training steps (batch intervals) with no other event nested in
  them (no checkpoint write, evaluation or compile): what a step costs when nothing interferes.
* ``step_time_deviation``: p90 of the last ~100 such steps minus the ideal: how much slower the
  recent slow steps are (stragglers, a noisy neighbour, a slowing input pipeline).
* ``interval_percent_5m`` / ``_15m`` / ``_60m``: effective (train) seconds in the last W minutes ÷ W,
  or ÷ the job's elapsed time while it is shorter than W.

Live (:class:`StepHealth`, :class:`RollingETT`, fed by ETTMonitor) and at the end (the summary,
from the ledgers) with the same rules.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

#: Rolling ETT% windows: metric suffix → seconds.
WINDOWS_S: dict[str, float] = {"5m": 300.0, "15m": 900.0, "60m": 3600.0}
IDEAL_WINDOW = 1000  # clean steps the ideal is the median of
RECENT_WINDOW = 100  # clean steps the deviation's p90 is taken over
_TRAIN = "train"


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), ``q`` in [0, 1]; ``values`` non-empty."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class _Span(Protocol):
    phase: str
    start: float
    end: float


class StepHealth:
    """Recent clean step durations, and the ideal and deviation they give (O(1) per step)."""

    def __init__(self, ideal_window: int = IDEAL_WINDOW, recent_window: int = RECENT_WINDOW) -> None:
        self._clean: deque[float] = deque(maxlen=ideal_window)
        self.recent_window = recent_window
        self.steps = 0
        self.clean_steps = 0

    def add(self, seconds: float, clean: bool) -> None:
        """One training step took ``seconds``; ``clean``: no other event was recorded inside it."""
        self.steps += 1
        if clean:
            self.clean_steps += 1
            self._clean.append(seconds)

    @property
    def ideal_s(self) -> float | None:
        return quantile(self._clean, 0.5) if self._clean else None

    @property
    def deviation_s(self) -> float | None:
        ideal = self.ideal_s
        if ideal is None:
            return None
        recent = list(self._clean)[-self.recent_window:]
        return quantile(recent, 0.9) - ideal

    def metrics(self) -> dict[str, float]:
        """``ett/ideal_step_s`` and ``ett/step_time_deviation``, once a clean step was seen."""
        ideal, deviation = self.ideal_s, self.deviation_s
        if ideal is None or deviation is None:
            return {}
        return {"ett/ideal_step_s": ideal, "ett/step_time_deviation": deviation}


class RollingETT:
    """ETT% over the last 5, 15 and 60 minutes from snapshots of the cumulative train seconds.

    A snapshot is kept at most every ``every_s`` seconds and for ``keep_s``, so memory is bounded
    (≤ 3600 snapshots) and a step costs O(1); a window's start falls between two snapshots, so its
    train seconds are exact to within one ``every_s`` of training.
    """

    def __init__(self, job_start: float, every_s: float = 1.0, keep_s: float = max(WINDOWS_S.values())) -> None:
        self.job_start = job_start
        self.every_s = every_s
        self.keep_s = keep_s
        self._times: list[float] = [job_start]  # nothing had trained at the job's start
        self._train: list[float] = [0.0]
        self._first = 0  # snapshots before this index are dropped (compacted now and then)

    def observe(self, now: float, train_s: float, force: bool = False) -> None:
        """The job had trained ``train_s`` seconds (cumulative, every attempt) at ``now``."""
        if not force and now - self._times[-1] < self.every_s:
            return
        if now < self._times[-1]:
            return  # a clock stepped back: keep the snapshots ordered
        self._times.append(now)
        self._train.append(train_s)
        # Keep the last snapshot at or before the longest window's start: value_at needs it.
        horizon = bisect.bisect_right(self._times, now - self.keep_s, lo=self._first) - 1
        if horizon > self._first:
            self._first = horizon
            if self._first > len(self._times) // 2:
                del self._times[:self._first], self._train[:self._first]
                self._first = 0

    def seed(self, spans: Iterable[_Span]) -> float:
        """Replay earlier attempts' segments (one rank's) before this attempt trains; returns their train seconds.

        Merged segments can span hours of steps: inside the last ``keep_s`` a snapshot is made every
        ``every_s`` through each train segment, so a window's start is placed as precisely as live.
        """
        spans = sorted(spans, key=lambda s: s.start)
        horizon = (spans[-1].end if spans else self.job_start) - self.keep_s
        train = 0.0
        for s in spans:
            if s.phase != _TRAIN or s.end <= s.start:
                continue
            t = max(s.start, horizon)
            while t < s.end:
                self.observe(t, train + (t - s.start), force=True)
                t += self.every_s
            train += s.end - s.start
            self.observe(s.end, train, force=True)
        return train

    def _train_at(self, t: float) -> float:
        i = bisect.bisect_right(self._times, t, lo=self._first) - 1
        return self._train[max(i, self._first)]

    def percent(self, now: float, train_s: float, window_s: float) -> float:
        elapsed = now - self.job_start
        if elapsed <= 0:
            return 0.0
        if elapsed <= window_s:
            return min(100.0, 100.0 * train_s / elapsed)
        return min(100.0, max(0.0, 100.0 * (train_s - self._train_at(now - window_s)) / window_s))

    def metrics(self, now: float, train_s: float) -> dict[str, float]:
        return {f"ett/interval_percent_{name}": self.percent(now, train_s, w) for name, w in WINDOWS_S.items()}


# ---------------------------------------------------------------------------------------- summary side
def step_health_from_events(events: Iterable[dict[str, Any]]) -> StepHealth:
    """Replay one rank's ledger events (every attempt): a step is clean when no other event starts inside it."""
    events = sorted(events, key=lambda e: e["start"])
    others = [e["start"] for e in events if e["phase"] != _TRAIN]  # sorted, as events are
    health = StepHealth()
    for e in events:
        if e["phase"] != _TRAIN:
            continue
        i = bisect.bisect_left(others, e["start"])
        nested = i < len(others) and others[i] < e["end"]
        health.add(e["end"] - e["start"], clean=not nested)
    return health


def interval_percents(segments: dict[int, list[_Span]], job_start: float, job_end: float) -> dict[str, float]:
    """ETT% over the last W minutes of the job (mean over ranks, as the job's ETT%), from the summary's segments."""
    ranks = [segs for segs in segments.values() if segs]
    out = {}
    for name, window in WINDOWS_S.items():
        since = max(job_end - window, job_start)
        span = job_end - since
        if span <= 0 or not ranks:
            out[f"interval_percent_{name}"] = 0.0
            continue
        train = sum(max(0.0, min(s.end, job_end) - max(s.start, since)) for segs in ranks for s in segs if s.phase == _TRAIN)
        out[f"interval_percent_{name}"] = round(100.0 * train / len(ranks) / span, 3)
    return out


def step_health_summary(events: Iterable[dict[str, Any]], segments: dict[int, list[_Span]], job_start: float,
                        job_end: float) -> dict[str, Any]:
    """The summary's ``step_health`` entry: ideal and deviation from one rank's steps, rolling ETT% at the job's end."""
    health = step_health_from_events(events)
    ideal, deviation = health.ideal_s, health.deviation_s
    return {
        "ideal_step_s": round(ideal, 6) if ideal is not None else None,
        "step_time_deviation": round(deviation, 6) if deviation is not None else None,
        "steps": health.steps,
        "clean_steps": health.clean_steps,
        **interval_percents(segments, job_start, job_end),
    }
