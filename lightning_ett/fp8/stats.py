"""The verdict on a layer: are its bad FP8 steps rare? A sequential test on the tail of its per-step SQNR.

**What is tested.** One observation per *window* of ``every_n_steps`` training steps: the worst
SQNR (dB) of the layer's measured GEMMs at the sampled step in that window, on the worst rank
that sampled it. A window is *bad* when that SQNR is below ``threshold_db``. The question is
the share ``p`` of bad windows: ``safe`` says ``p`` is small (at most ``tail / 5``), ``unsafe``
says it is ``tail`` or more — the ``tail``-quantile of per-step SQNR is below the threshold.

**Why the tail, not the mean.** FP8 fails on rare steps: an outlier batch whose amax sets the
scale and flushes the rest of the tensor, gradients that underflow e5m2 late in training. A
layer at 30 dB on most steps and 5 dB on one in ten has a comfortable mean and a real problem.

**The test: Wald's sequential probability ratio test** on the bad/good sequence, H0 ``p =
tail / 5`` against H1 ``p = tail``. Each window adds ``log(p1 / p0)`` (bad) or ``log((1 - p1) /
(1 - p0))`` (good) to a log-likelihood ratio; ``safe`` when it falls to ``log(beta)``, ``unsafe``
when it rises to ``log(1 / alpha)``. Wald's inequalities then bound the false-``safe`` rate at
``p = tail`` by ``beta = 1 - confidence`` and the false-``unsafe`` rate at ``p = tail / 5`` by
``alpha = 0.1`` (his approximate boundaries, ``beta / (1 - alpha)``, would allow 5.6 %), and they
hold whatever the number of looks, which is why the probe may look after every sample and stop.
At ``tail = 0.1``, 95 %: 36 clean windows say ``safe``; a bad window costs about 19 more; two
bad windows close together say ``unsafe`` (a layer bad at every step: after two windows). A
single bad window does not: ordinary layers dip now and then (e5m2 gradients sit near 25 dB),
and calling them unsafe for it would cost the user the FP8 speed-up of healthy layers.

**Ranks and autocorrelation.** Same-window samples of several ranks are one observation (their
minimum: a bad step on one rank reaches every rank through the all-reduced gradient), not
several. The bad share is therefore the job's — of steps bad on any rank — and grows with
the ranks that happen to sample a window: a layer with rare bad batches looks worse on 8
ranks than on 1, as it is. Windows are a drifting series, and neighbouring windows are alike: with a lag-1
autocorrelation ``rho``, ``n`` windows carry the information of about ``n (1 - rho) / (1 +
rho)`` independent ones (the AR(1) effective sample size), so the ratio is weighted by
``(1 - rho) / (1 + rho)`` — all of it, re-weighted at every window with the estimate so far, so
that early windows, taken before the correlation showed, are not banked at full weight. ``rho``
is estimated from the good windows until the verdict (a bad window's outlying SQNR would wash
it out just when it matters), counted where it is significant (above ``2 / sqrt(n)``, the 95 %
band of an independent series) and clamped to [0, 0.9]. It is the SQNR level's correlation, a
stand-in for that of the bad windows (unseen until they come): slow drift raises it and asks
for more windows — the conservative side, named in the report as the reason when a layer
stays undecided. What it cannot see is bad windows that cluster while the level between them
is white (bad batches that come in runs, unannounced): there the windows are as independent
as their spacing makes them, and the guarantee holds for runs shorter than ``every_n_steps``.

**Re-checks.** After ``safe`` the layer is still sampled, at a lower rate, for the rest of
training, and the ratio goes on from the ``safe`` boundary, held there from below (a CUSUM,
the SPRT's monitoring form): good windows cannot bank credit, and a run of bad ones — about
five within a dozen or so windows — turns the verdict to ``unsafe``, recorded with the window
it was safe at. The monitoring boundary is twice the test's (``2 log(1 / alpha)``): a layer
at the safe bad share (``tail / 5``) re-checked 2000 times flips in ~3 % of runs (at the
test's own boundary, 25 %), and a bad share of 0.2 is caught after a median 28 re-checks.
The simulation in ``tests/test_fp8_stats.py`` checks the false-``safe`` rate on series with
rare bad steps, clustered bad steps and drift, and the re-checks' false alarms.

Hand-written because it is a few lines on top of Wald's formulas; SciPy and statsmodels have
fixed-sample binomial tests, not a sequential one with an autocorrelation weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SAFE, UNSAFE, UNDECIDED = "safe", "unsafe", "undecided"
MAX_RHO = 0.9


@dataclass
class RunningStats:
    """Count, sum and sum of squares (float64): a mean that ranks combine by adding, and that a restart carries on."""

    count: float = 0.0
    total: float = 0.0
    total_sq: float = 0.0

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.count += 1
            self.total += value
            self.total_sq += value * value

    def merge(self, other: RunningStats) -> RunningStats:
        return RunningStats(self.count + other.count, self.total + other.total, self.total_sq + other.total_sq)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def to_list(self) -> list[float]:
        return [self.count, self.total, self.total_sq]

    @classmethod
    def from_list(cls, values: list[float]) -> RunningStats:
        count, total, total_sq = (float(v) for v in values)
        return cls(count, total, total_sq)


FALSE_UNSAFE = 0.1  # alpha: how often a layer with a bad share of tail / 5 is called unsafe


@dataclass(frozen=True)
class Plan:
    """The SPRT's increments and boundaries for ``tail`` and ``confidence``."""

    bad: float  # log(p1 / p0)
    good: float  # log((1 - p1) / (1 - p0)), negative
    lower: float  # safe at or below
    upper: float  # unsafe at or above
    monitor_upper: float  # unsafe at or above once safe: twice the evidence (see the module's docstring)

    @classmethod
    def of(cls, tail: float, confidence: float) -> Plan:
        p1, p0 = tail, tail / 5
        beta = 1 - confidence
        upper = math.log(1 / FALSE_UNSAFE)
        return cls(math.log(p1 / p0), math.log((1 - p1) / (1 - p0)), math.log(beta), upper, 2 * upper)

    def clean_windows(self, llr: float = 0.0, weight: float = 1.0) -> int:
        """Good windows that take the ratio from ``llr`` to ``safe``."""
        return max(math.ceil((llr - self.lower) / (-self.good * weight) - 1e-9), 0)


@dataclass(frozen=True)
class Decision:
    """What a layer's window series says, and why."""

    verdict: str
    windows: int  # observations so far
    needed: int  # windows to the verdict safe (so far, or from here if all clean): 0 once decided
    rho: float
    safe_at: int | None  # the window at which the test first said safe
    unsafe_at: int | None  # the window at which it said unsafe
    bad_windows: int  # windows below the threshold
    bad_db: float | None  # the SQNR of the window that decided unsafe
    worst_db: float | None  # the lowest window seen
    quantile_db: float | None  # the empirical ``tail``-quantile of the windows (a description, not the test)


def decide(series: list[tuple[int, float]], threshold_db: float, tail: float, confidence: float) -> Decision:
    """The verdict on ``series`` — (window, worst SQNR dB), one per window, in window order.

    A replay of the sequential test, window by window, from the start: every rank and every
    restart reaches the same verdict from the same windows, and ``safe_at`` is the window at
    which the looks first said ``safe``. An infinite SQNR (an exact FP8 GEMM, e.g. an all-zero
    input) is a good window, a NaN one (the FP8 product overflowed) a bad one.
    """
    plan = Plan.of(tail, confidence)
    series = [(w, -math.inf if math.isnan(v) else v) for w, v in series]  # NaN: the FP8 GEMM overflowed
    values = [v for _, v in series]
    llr, weight, rho = 0.0, 1.0, 0.0
    safe_at = unsafe_at = bad_db = None
    lag = _Lag1()
    bad_windows = 0
    raw = 0.0  # the unweighted ratio of the windows before the verdict: re-weighted as the estimate of rho moves
    for window, value in series:
        bad = value < threshold_db
        bad_windows += bad
        step = plan.bad if bad else plan.good
        if safe_at is None:
            if not bad:  # (a bad window's outlying SQNR would wash the estimate out just when it matters)
                lag.add(min(value, threshold_db + 40))  # (an exact GEMM, +inf, would be such an outlier too)
            rho = lag.significant()
            weight = (1 - rho) / (1 + rho)
            raw += step
            llr = raw * weight
        else:  # monitoring: the weight of the verdict; no credit banked below the safe boundary
            llr = max(llr + step * weight, plan.lower)
        if llr >= (plan.upper if safe_at is None else plan.monitor_upper):
            unsafe_at, bad_db = window, value
            break
        if safe_at is None and llr <= plan.lower and not bad:
            safe_at, llr = window, plan.lower
    verdict = UNSAFE if unsafe_at is not None else SAFE if safe_at is not None else UNDECIDED
    needed = 0 if verdict != UNDECIDED else len(series) + plan.clean_windows(llr, weight)
    ordered = sorted(values)
    quantile = ordered[min(int(tail * len(ordered)), len(ordered) - 1)] if ordered else None
    return Decision(verdict, len(series), needed, rho, safe_at, unsafe_at, bad_windows, bad_db,
                    min(values) if values else None, quantile)


class _Lag1:
    """The lag-1 autocorrelation of a growing series, in O(1) a value (the replay above looks at every prefix), where it
    is distinguishable from noise (above ``2 / sqrt(n)``, the 95 % band of an independent series; else 0: a noisy
    estimate would otherwise ask independent windows for up to twice the plan), clamped to ``MAX_RHO``."""

    def __init__(self) -> None:
        self.n, self.total, self.total_sq, self.cross, self.first, self.last = 0, 0.0, 0.0, 0.0, 0.0, 0.0

    def add(self, value: float) -> None:
        if self.n:
            self.cross += self.last * value
        else:
            self.first = value
        self.n += 1
        self.total += value
        self.total_sq += value * value
        self.last = value

    def significant(self) -> float:
        n = self.n
        if n < 3:
            return 0.0
        mean = self.total / n
        var = self.total_sq - n * mean * mean
        if var <= 1e-12 * max(self.total_sq, 1.0):
            return 0.0
        # sum over i of (x_i - m)(x_{i+1} - m), expanded
        cov = self.cross - mean * (2 * self.total - self.first - self.last) + (n - 1) * mean * mean
        rho = cov / var
        return min(rho, MAX_RHO) if rho > 2 / math.sqrt(n) else 0.0
