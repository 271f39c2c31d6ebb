"""Step-time health (ideal step, deviation, rolling ETT%) and the straggler digest, live and from ledgers."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from lightning_ett.instrument.ledger import RankLedger
from lightning_ett.instrument.report import print_report
from lightning_ett.instrument.step_health import (
    RollingETT,
    StepHealth,
    interval_percents,
    quantile,
    step_health_from_events,
)
from lightning_ett.instrument.straggler_facts import straggler_digest, straggler_line
from lightning_ett.instrument.summary import Segment, summarize
from lightning_ett.instrument.timeline import STRAGGLER_FACT


def test_quantile_interpolates_as_numpy_does():
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.9) == pytest.approx(3.7)
    assert quantile([5.0], 0.9) == 5.0


def test_ideal_is_the_median_of_clean_steps_and_deviation_the_recent_p90_beyond_it():
    health = StepHealth(ideal_window=1000, recent_window=100)
    assert health.metrics() == {}
    for _ in range(900):
        health.add(0.1, clean=True)
    health.add(5.0, clean=False)  # a step with a checkpoint write in it: not a step's cost
    assert health.ideal_s == pytest.approx(0.1) and health.deviation_s == pytest.approx(0.0)
    for _ in range(20):  # the job got slower lately: 20 % of the last 100 steps at 0.3 s
        health.add(0.3, clean=True)
    assert health.ideal_s == pytest.approx(0.1)
    assert health.deviation_s == pytest.approx(0.2)
    assert health.steps == 921 and health.clean_steps == 920
    assert set(health.metrics()) == {"ett/ideal_step_s", "ett/step_time_deviation"}


def test_rolling_ett_counts_train_seconds_in_the_last_window_only():
    job_start = 0.0
    rolling = RollingETT(job_start)
    train = 0.0
    # 30 minutes training 100 %, then 30 minutes at 50 % (1 s train, 1 s checkpointing...).
    for t in range(1, 1801):
        train += 1.0
        rolling.observe(float(t), train)
    assert rolling.percent(1800.0, train, 300.0) == pytest.approx(100.0)
    for t in range(1801, 3601):
        train += 0.5
        rolling.observe(float(t), train)
    now = 3600.0
    metrics = rolling.metrics(now, train)
    assert metrics["ett/interval_percent_5m"] == pytest.approx(50.0, abs=0.5)
    assert metrics["ett/interval_percent_15m"] == pytest.approx(50.0, abs=0.5)
    assert metrics["ett/interval_percent_60m"] == pytest.approx(75.0, abs=0.5)
    # Shorter than the window so far: divided by the elapsed time, not by W.
    young = RollingETT(0.0)
    young.observe(60.0, 30.0)
    assert young.percent(60.0, 30.0, 300.0) == pytest.approx(50.0)


def test_rolling_ett_keeps_memory_bounded_and_takes_snapshots_at_most_every_second():
    rolling = RollingETT(0.0)
    for i in range(1, 200_001):  # 20 000 s of 10 steps a second
        rolling.observe(i / 10, i / 10)
    assert len(rolling._times) - rolling._first <= 3602
    assert len(rolling._times) <= 2 * 3602 + 2
    assert rolling.percent(20_000.0, 20_000.0, 3600.0) == pytest.approx(100.0, abs=0.1)


def test_rolling_ett_seeds_from_earlier_attempts_segments():
    # Attempt 0 trained 0..600 s (one merged segment), then the job was down until 900 s.
    rolling = RollingETT(0.0)
    train = rolling.seed([Segment("launch", 0.0, 10.0), Segment("train", 10.0, 600.0), Segment("shutdown", 600.0, 610.0)])
    assert train == pytest.approx(590.0)
    # At 900 s the last 5 minutes (600..900) trained nothing; the last 15 minutes hold 590 s of 900.
    assert rolling.percent(900.0, train, 300.0) == pytest.approx(0.0, abs=0.4)
    assert rolling.percent(900.0, train, 900.0) == pytest.approx(100 * 590 / 900, abs=0.2)
    # 400..600 trained: a window starting inside the merged segment is placed to within a second.
    assert rolling.percent(700.0, train, 300.0) == pytest.approx(100 * 200 / 300, abs=0.4)


def _event(phase: str, start: float, end: float, step: int | None = None) -> dict:
    e = {"kind": "event", "phase": phase, "start": start, "end": end, "rank": 0, "attempt": 0}
    if step is not None:
        e["step"] = step
    return e


def test_steps_with_an_event_nested_in_them_are_left_out_of_the_ideal():
    events = [_event("train", float(i), i + 1.0, i) for i in range(10)]
    events[3] = _event("train", 3.0, 4.0 + 9.0, 3)  # a slow step ...
    events += [_event("checkpoint_save", 3.5, 12.5)]  # ... because a save was nested in it
    events += [_event("eval", 20.0, 25.0)]  # between steps: not inside any
    health = step_health_from_events(events)
    assert health.steps == 10 and health.clean_steps == 9
    assert health.ideal_s == pytest.approx(1.0)


def test_interval_percents_at_the_end_are_the_mean_over_ranks():
    segments = {0: [Segment("train", 0.0, 3600.0)], 1: [Segment("train", 0.0, 3300.0), Segment("other", 3300.0, 3600.0)]}
    out = interval_percents(segments, 0.0, 3600.0)
    assert out["interval_percent_5m"] == pytest.approx(50.0)  # rank 1 stopped training 5 minutes ago
    assert out["interval_percent_60m"] == pytest.approx(100 * 6900 / 7200, abs=1e-3)


def _straggler_fact(step: int, straggler: int | None, scores: list[float], side: str | None = "data") -> dict:
    return {"kind": "fact", "name": STRAGGLER_FACT, "time": float(step), "rank": 0, "attempt": 0, "step": step,
            "straggler": straggler, "score_s": max(scores), "side": side, "scores": scores, "batches": 25,
            "threshold_s": 0.002}


def test_straggler_digest_and_report_line():
    assert straggler_digest([]) is None and straggler_line(None) is None
    quiet = [_straggler_fact(50, None, [0.0, 0.0005])]
    assert straggler_line(straggler_digest(quiet)) is None  # no straggler: no line
    # Named in one window, then not, then again: never two in a row, so no line (one noisy gather names a rank).
    flickers = [_straggler_fact(25 * i, 1 if i % 2 else None, [0.0, 0.05 if i % 2 else 0.0]) for i in range(1, 6)]
    flickering = straggler_digest(flickers)
    assert flickering["worst"]["windows"] == 3 and flickering["worst"]["streak"] == 1
    assert straggler_line(flickering) is None
    facts = quiet + [_straggler_fact(75, 1, [0.0, 0.048]), _straggler_fact(100, 1, [0.0, 0.052]),
                     {"name": STRAGGLER_FACT, "scores": "garbled"}]  # a hand-edited fact is left out
    digest = straggler_digest(facts)
    assert digest["windows"] == 3 and digest["straggler"] == 1 and digest["named"] == {"1": 2}
    assert digest["latest"]["scores"] == {"0": 0.0, "1": 0.052}
    assert digest["worst"] == {"rank": 1, "windows": 2, "score_s": 0.05, "side": "data", "first_step": 75, "last_step": 100,
                               "streak": 2}
    assert straggler_line(digest).startswith("straggler: rank 1, others waited 50 ms/batch (data side); named in 2 of 3")


def test_a_slow_nodes_ranks_named_by_turns_make_one_streak_in_the_report_as_in_the_live_warning():
    turns = [{**_straggler_fact(25 * i, rank, [0.0, 0.05, 0.05]), "streak": i} for i, rank in [(1, 1), (2, 2), (3, 1)]]
    digest = straggler_digest(turns)
    assert digest["worst"]["rank"] == 1 and digest["worst"]["streak"] == 3  # the tracker's streak, as it warned
    assert straggler_line(digest).startswith("straggler: rank 1, others waited 50 ms/batch")
    peaked_elsewhere = [{**_straggler_fact(25, 1, [0.0, 0.05, 0.0]), "streak": 1},
                        {**_straggler_fact(50, 2, [0.0, 0.0, 0.05]), "streak": 2},  # the warning fired here
                        _straggler_fact(75, None, [0.0, 0.0, 0.0]) | {"streak": 0},
                        {**_straggler_fact(100, 1, [0.0, 0.05, 0.0]), "streak": 1}]
    digest = straggler_digest(peaked_elsewhere)
    assert digest["worst"]["rank"] == 1 and digest["worst"]["streak"] == 2 and straggler_line(digest) is not None


def test_a_streak_is_credited_to_the_ranks_it_named_not_to_the_rank_named_most_often():
    """Review 68: rank 3 named 3 windows in a row (the warning fired), then rank 7 in 4 windows, never twice in a row:
    the report named rank 7 with rank 3's streak. The warning's rank comes first, with its own streak."""
    def fact(i: int, rank: int | None, streak: int) -> dict:
        return {**_straggler_fact(25 * i, rank, [0.0] * 8 if rank is None else [0.05 if r == rank else 0.0 for r in range(8)]),
                "streak": streak}

    facts = [fact(1, 3, 1), fact(2, 3, 2), fact(3, 3, 3)]
    for i in range(4, 12, 2):
        facts += [fact(i, 7, 1), fact(i + 1, None, 0)]
    digest = straggler_digest(facts)
    assert digest["named"] == {"3": 3, "7": 4}
    assert digest["worst"]["rank"] == 3 and digest["worst"]["streak"] == 3
    assert straggler_line(digest).startswith("straggler: rank 3,")
    alone = straggler_digest(facts[3:])  # rank 7's windows alone: never two in a row, no line
    assert alone["worst"]["rank"] == 7 and alone["worst"]["streak"] == 1 and straggler_line(alone) is None
    # A streak that rank 7 began and rank 3 continued, where the warning named rank 3 (the facts say so): rank 7,
    # named more often, is not the one the report names (review 69).
    begun = [fact(1, 7, 1), fact(2, None, 0), fact(3, 7, 1), fact(4, None, 0), fact(5, 7, 1),
             {**fact(6, 3, 2), "warned": True}]
    digest = straggler_digest(begun)
    assert digest["named"] == {"3": 1, "7": 3} and digest["worst"]["rank"] == 3 and digest["worst"]["streak"] == 2


def test_the_summary_and_the_report_carry_step_health_and_stragglers():
    events = [_event("train", 10.0 + i, 11.0 + i, i) for i in range(20)]
    ledger = RankLedger(0, 0, header={"job_start": 0.0}, events=events,
                        facts=[_straggler_fact(10, 1, [0.0, 0.03], "compute"), _straggler_fact(11, 1, [0.0, 0.03], "compute")])
    summary = summarize([ledger, RankLedger(0, 1, header={"job_start": 0.0}, events=events)])
    d = summary.to_dict()
    assert d["step_health"]["ideal_step_s"] == pytest.approx(1.0) and d["step_health"]["clean_steps"] == 20
    assert d["step_health"]["interval_percent_5m"] == pytest.approx(100 * 20 / 30, abs=1e-3)  # 30 s of wall so far
    assert d["stragglers"]["worst"]["rank"] == 1
    assert not [f for f in d["facts"] if f["name"] == STRAGGLER_FACT]  # one per window: digested, not listed
    out = io.StringIO()
    print_report(summary, Console(file=out, width=200))
    assert "straggler: rank 1, others waited 30 ms/batch (compute side)" in out.getvalue()
