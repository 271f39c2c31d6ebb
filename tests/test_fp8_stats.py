"""FP8Probe's verdict on synthetic SQNR series: the false-"safe" rate holds with rare bad steps, clusters and drift."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from lightning_ett.fp8.stats import (
    FALSE_UNSAFE,
    MAX_RHO,
    SAFE,
    UNDECIDED,
    UNSAFE,
    Plan,
    _Lag1,
    decide,
)

THRESHOLD, TAIL, CONFIDENCE = 20.0, 0.1, 0.95
RUNS = 4000
# A Monte-Carlo rate is itself noisy: 3 standard errors over RUNS runs at the rate stated.
MARGIN = {rate: 3 * math.sqrt(rate * (1 - rate) / RUNS) for rate in (1 - CONFIDENCE, FALSE_UNSAFE)}


def lag1_autocorrelation(values: list[float]) -> float:
    """The textbook lag-1 autocorrelation (0 below 3 values or with no variance): the oracle for ``_Lag1``."""
    n = len(values)
    if n < 3:
        return 0.0
    mean = sum(values) / n
    centred = [v - mean for v in values]
    var = sum(c * c for c in centred)
    return sum(a * b for a, b in itertools.pairwise(centred)) / var if var > 0 else 0.0


def significant_autocorrelation(values: list[float]) -> float:
    rho = lag1_autocorrelation(values)
    return min(rho, MAX_RHO) if rho > 2 / math.sqrt(max(len(values), 1)) else 0.0


def iid(rng: random.Random, bad_share: float, n: int) -> list[float]:
    """Mostly ~27 dB, and a share ``bad_share`` of windows below the threshold (an outlier batch: ~8 dB)."""
    return [rng.gauss(8, 3) if rng.random() < bad_share else rng.gauss(27, 2) for _ in range(n)]


def clustered(rng: random.Random, bad_share: float, n: int, stay: float = 0.8) -> list[float]:
    """Bad windows come in runs (a Markov chain that stays bad with probability ``stay``), on a drifting AR(1) level."""
    enter = bad_share * (1 - stay) / (1 - bad_share)  # the chain's stationary bad share is ``bad_share``
    bad, level, out = rng.random() < bad_share, 0.0, []
    for _ in range(n):
        bad = rng.random() < (stay if bad else enter)
        level = 0.9 * level + rng.gauss(0, 1)
        out.append(rng.gauss(8, 3) if bad else 27 + level)
    return out


def first_verdict(values: list[float]) -> str:
    """The verdict at the first look that decides, as the probe's sampling sees it (looks after every window):
    ``decide`` replays those looks, and ``safe_at`` is where they first said safe."""
    found = decide(list(enumerate(values)), THRESHOLD, TAIL, CONFIDENCE)
    return SAFE if found.safe_at is not None else found.verdict


def rate(make, bad_share: float, verdict: str, n: int = 300) -> float:  # type: ignore[no-untyped-def]
    rng = random.Random(1234)
    return sum(first_verdict(make(rng, bad_share, n)) == verdict for _ in range(RUNS)) / RUNS


def test_the_plan_at_a_tenth_and_95_percent():
    plan = Plan.of(TAIL, CONFIDENCE)
    assert plan.clean_windows() == 36  # log(0.05) / log(0.9 / 0.98)
    assert round(plan.bad / -plan.good) == 19  # one bad window costs ~19 clean ones
    assert plan.clean_windows(weight=1 / 3) == 106  # at rho = 0.5 each window counts a third


def test_a_clean_layer_is_safe_after_the_plan_and_not_before():
    rng = random.Random(0)
    values = [rng.gauss(27, 1.0) for _ in range(40)]
    early = decide(list(enumerate(values[:20])), THRESHOLD, TAIL, CONFIDENCE)
    assert early.verdict == UNDECIDED and early.windows == 20 and early.needed == 36
    done = decide(list(enumerate(values)), THRESHOLD, TAIL, CONFIDENCE)
    assert done.verdict == SAFE and done.safe_at == 35 and done.needed == 0


def test_one_dip_costs_windows_two_close_ones_decide_unsafe():
    clean = [27.0 + (i % 3) for i in range(60)]
    one_dip = decide(list(enumerate([*clean[:10], 18.0, *clean[:50]])), THRESHOLD, TAIL, CONFIDENCE)
    assert one_dip.verdict == SAFE and one_dip.safe_at > 36 and one_dip.bad_windows == 1
    two = decide(list(enumerate([*clean[:3], 12.0, 27.0, 9.0, *clean])), THRESHOLD, TAIL, CONFIDENCE)
    assert two.verdict == UNSAFE and two.unsafe_at == 5 and two.bad_db == 9.0


def test_a_layer_at_27_db_with_a_bad_step_in_ten_is_unsafe_though_its_mean_is_high():
    rng = random.Random(3)
    values = iid(rng, 0.1, 200)
    assert sum(values) / len(values) > 23  # the mean the old verdict used: comfortably "safe"
    assert decide(list(enumerate(values)), THRESHOLD, TAIL, CONFIDENCE).verdict == UNSAFE


@pytest.mark.parametrize("bad_share", [0.1, 0.2])
def test_rare_bad_steps_are_called_safe_at_most_5_percent_of_the_time(bad_share):
    assert rate(iid, bad_share, SAFE) <= 1 - CONFIDENCE + MARGIN[1 - CONFIDENCE]


@pytest.mark.parametrize("bad_share", [0.1, 0.2])
def test_clustered_bad_steps_on_a_drifting_level_are_called_safe_at_most_5_percent_of_the_time(bad_share):
    # Without the autocorrelation weight, runs of bad windows let long clean stretches pass far more often (0.3).
    assert rate(clustered, bad_share, SAFE) <= 1 - CONFIDENCE + MARGIN[1 - CONFIDENCE]


def test_healthy_layers_that_dip_now_and_then_are_called_unsafe_at_most_10_percent_of_the_time():
    assert rate(iid, TAIL / 5, UNSAFE) <= FALSE_UNSAFE + MARGIN[FALSE_UNSAFE]


def rechecked(values: list[float], every: int = 4) -> list[tuple[int, float]]:
    """The windows the probe measures: every one until the verdict, then one in ``every`` (its re-checks)."""
    safe_at = decide(list(enumerate(values)), THRESHOLD, TAIL, CONFIDENCE).safe_at
    return [(w, v) for w, v in enumerate(values) if safe_at is None or w <= safe_at or w % every == 0]


def test_drift_into_bad_steps_after_the_verdict_turns_it_unsafe_through_the_rechecks():
    """Safe for the first 100 windows, then e5m2 underflow sets in: a bad window in five, for 800 windows. The
    re-checks (one window in four after the verdict) see it every time."""
    rng = random.Random(7)
    for _ in range(200):
        values = [rng.gauss(27, 1.0) for _ in range(100)] + iid(rng, 0.2, 800)
        found = decide(rechecked(values), THRESHOLD, TAIL, CONFIDENCE)
        assert found.verdict == UNSAFE and found.safe_at is not None and found.unsafe_at > found.safe_at


def test_the_rechecks_leave_a_healthy_layer_safe_over_a_long_run():
    """At the safe bad share (tail / 5 = 2 %), 2000 re-checks (8000 windows: 80000 steps at the default window):
    the CUSUM's doubled boundary flips at most 5 % of such layers (~3 % measured; at the test's own boundary, 25 %)."""
    rng = random.Random(11)
    runs = 200
    found = [decide(rechecked(iid(rng, TAIL / 5, 8000)), THRESHOLD, TAIL, CONFIDENCE) for _ in range(runs)]
    flipped = sum(f.safe_at is not None and f.unsafe_at is not None for f in found)  # (not the test's own 10 %)
    assert flipped / runs <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / runs), flipped


def test_the_running_autocorrelation_is_the_direct_one():
    rng = random.Random(9)
    values = [rng.gauss(30, 1) + (3 if i % 7 < 3 else 0) for i in range(60)]
    lag = _Lag1()
    for i, v in enumerate(values):
        lag.add(v)
        assert lag.significant() == pytest.approx(significant_autocorrelation(values[: i + 1]), abs=1e-9)


def test_the_autocorrelation_estimate_sees_runs_and_not_noise():
    rng = random.Random(5)
    noise = [rng.gauss(0, 1) for _ in range(500)]
    ar = [0.0]
    for _ in range(499):
        ar.append(0.8 * ar[-1] + rng.gauss(0, 1))
    seen = []
    for series in (noise, ar):
        lag = _Lag1()
        for v in series:
            lag.add(v)
        seen.append(lag.significant())
    assert abs(lag1_autocorrelation(noise)) < 0.1 and seen[0] == 0.0
    assert 0.7 < lag1_autocorrelation(ar) < 0.9 and 0.7 < seen[1] < 0.9
