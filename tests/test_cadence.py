"""The ETT-optimal checkpoint cadence: Young/Daly from measured cost and MTBF, bounds, adaptation, ledger MTBF."""

from __future__ import annotations

import itertools
import math
import time

import pytest
from conftest import REPO, run_script
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ett import AsyncCheckpoint
from lightning_ett.checkpoint import layout as fmt
from lightning_ett.checkpoint.cadence import (
    FIRST_SAVE_STEPS,
    PRIOR_MTBF_HOURS,
    CadenceDecision,
    CadenceTracker,
    estimate_mtbf_s,
    young_daly_interval_s,
)
from lightning_ett.instrument.cadence_facts import cadence_line
from lightning_ett.instrument.environment import ENV_ATTEMPT, ENV_JOB_START, ENV_RUN_DIR
from lightning_ett.instrument.ledger import (
    LedgerWriter,
    failed_attempts,
    launcher_ledger_path,
    ledger_path,
    read_ledger,
)
from lightning_ett.instrument.summary import summarize_run_dir

JOB = str(REPO / "tests" / "scripts" / "async_job.py")


def tracker(cost: float, step: float, write: float = 0.0, max_s: float = 3600.0) -> CadenceTracker:
    t = CadenceTracker(max_interval_s=max_s)
    t.inject(save_cost_s=cost, step_s=step, write_s=write)
    return t


@pytest.mark.parametrize(("cost", "mtbf", "step"), [(2.0, 3600.0, 0.5), (0.3, 600.0, 0.05), (12.0, 4 * 3600.0, 1.7)])
def test_the_interval_is_the_young_daly_optimum_for_injected_cost_and_mtbf(cost, mtbf, step):
    decision = tracker(cost, step).decide(mtbf, "given")
    expected_s = math.sqrt(2 * cost * mtbf)
    assert young_daly_interval_s(cost, mtbf) == pytest.approx(expected_s)
    assert decision.interval_steps == round(expected_s / step)
    assert decision.bound is None
    assert decision.expected_loss_per_failure_s == pytest.approx(decision.interval_s / 2)
    # It is the minimum of the first-order overhead C/T + T/(2 MTBF): one step either way costs more.
    overhead = lambda steps: cost / (steps * step) + steps * step / (2 * mtbf)
    assert overhead(decision.interval_steps) <= min(overhead(decision.interval_steps - 1), overhead(decision.interval_steps + 1))
    assert decision.predicted_overhead == pytest.approx(overhead(decision.interval_steps))


def test_the_interval_is_bounded_by_the_write_time_and_the_maximum():
    rare = tracker(cost=50.0, step=1.0, max_s=600.0).decide(mtbf_s=100 * 3600.0, mtbf_source="given")
    assert (rare.interval_steps, rare.bound) == (600, "max")
    # A save cheap for training but slow to write is never due before the previous one is durable.
    often = tracker(cost=0.001, step=0.1, write=20.0).decide(mtbf_s=60.0, mtbf_source="given")
    assert often.bound == "min" and often.interval_s >= 1.25 * 20.0


def test_the_interval_adapts_when_the_measured_cost_changes():
    t = CadenceTracker(max_interval_s=1e9)
    for _ in range(10):
        t.observe_step(compute_s=0.1, wall_s=0.1, writing=False)
    for _ in range(5):
        t.save_started()
        t.observe_save(blocked_s=0.5, write_s=1.0)
    cheap = t.decide(mtbf_s=7200.0, mtbf_source="given")
    assert cheap.save_cost_s == pytest.approx(0.5)
    # Saves become 4x as expensive (a bigger model, a slower disk): within a few saves the
    # median cost follows, and the interval grows by sqrt(4) = 2.
    for _ in range(3):
        t.save_started()
        t.observe_save(blocked_s=2.0, write_s=1.0)
    dear = t.decide(mtbf_s=7200.0, mtbf_source="given")
    assert dear.save_cost_s == pytest.approx(2.0)
    assert dear.interval_steps == pytest.approx(2 * cheap.interval_steps, abs=1)


def test_a_fits_first_save_sets_the_cost_only_until_a_typical_save_is_measured():
    t = CadenceTracker(max_interval_s=1e9)
    for _ in range(10):
        t.observe_step(compute_s=0.1, wall_s=0.1, writing=False)
    t.observe_save(blocked_s=11.0, write_s=12.0, typical=False)  # the job's first save: allocates the buffers
    assert t.save_cost_s == pytest.approx(11.0)  # all there is to go on
    t.observe_save(blocked_s=0.8, write_s=1.0)
    assert t.save_cost_s == pytest.approx(0.8)  # not the mean of 11 and 0.8: the allocation is not a save's cost
    t.observe_save(blocked_s=1.2, write_s=1.0)
    restarted = CadenceTracker(max_interval_s=1e9)
    restarted.load_state_dict(t.state_dict())
    restarted.observe_save(blocked_s=9.0, write_s=10.0, typical=False)  # the restarted fit's first save
    assert restarted.save_cost_s == pytest.approx(1.0)  # the restored costs stand (median of 0.8 and 1.2)
    fresh = CadenceTracker(max_interval_s=1e9)
    fresh.observe_save(blocked_s=9.0, write_s=10.0, typical=False)
    restored = CadenceTracker(max_interval_s=1e9)
    restored.load_state_dict(fresh.state_dict())  # saved while only the first save was known: still provisional
    restored.observe_save(blocked_s=2.0, write_s=1.0)
    assert restored.save_cost_s == pytest.approx(2.0)


def test_the_true_cost_adds_the_slowdown_of_the_steps_that_ran_during_the_write():
    t = CadenceTracker(max_interval_s=1e9)
    for _ in range(20):
        t.observe_step(compute_s=0.100, wall_s=0.12, writing=False)
    t.save_started()
    for _ in range(4):
        t.observe_step(compute_s=0.150, wall_s=0.17, writing=True)  # 50 ms slower each while the writer runs
    assert t.observe_save(blocked_s=0.05, write_s=0.6) == pytest.approx(0.05 + 4 * 0.05)
    restored = CadenceTracker(max_interval_s=1e9)
    restored.load_state_dict(t.state_dict())  # a restart keeps what was measured
    assert (restored.save_cost_s, restored.write_s) == (t.save_cost_s, t.write_s)
    assert restored.step_s == t.step_s


def test_before_the_first_failure_the_mtbf_is_a_third_of_the_jobs_age():
    # A young job without failures saves often, an old one rarely; the first failure switches to the observed rate.
    young, old = estimate_mtbf_s(0, 60.0), estimate_mtbf_s(0, 6 * 3600.0)
    assert young[0] == pytest.approx(20.0) and old[0] == pytest.approx(7200.0) and "age/3" in young[1]
    assert young_daly_interval_s(0.5, young[0]) < young_daly_interval_s(0.5, old[0])
    assert estimate_mtbf_s(3, 3 * 3600.0)[0] == pytest.approx(3600.0)
    assert estimate_mtbf_s(0, 0.0)[0] == pytest.approx(3600 * PRIOR_MTBF_HOURS)  # age unknown: the prior


def test_mtbf_comes_from_the_jobs_ledger_of_past_attempts(tmp_path, monkeypatch):
    run = tmp_path / "run"
    # attempt 0: killed (the launcher saw it); 1: finished (a fit that ended, then a longer one); 2: killed
    # without a launcher (no status); 3: the current one.
    for attempt, status in ((0, None), (1, "finished"), (2, None), (3, None)):
        writer = LedgerWriter(ledger_path(run, attempt, 0))
        writer.append({"kind": "header", "rank": 0, "attempt": attempt})
        writer.append({"kind": "event", "phase": "train", "start": 1.0, "end": 2.0, "rank": 0, "attempt": attempt})
        if status:
            writer.append({"kind": "status", "status": status, "time": 2.0})
        writer.close()
    launcher = LedgerWriter(launcher_ledger_path(run, 0))
    launcher.append({"kind": "failure", "attempt": 0, "rank": 1, "time": 2.0})
    launcher.close()
    assert [lg.status for lg in read_ledger(run)] == [None, "finished", None, None]
    assert failed_attempts(run, before=3) == 2
    assert failed_attempts(run, before=2) == 1
    # The current attempt, as `lightning run` starts it: AsyncCheckpoint's setup reads the ledger.
    monkeypatch.setenv(ENV_RUN_DIR, str(run))
    monkeypatch.setenv(ENV_ATTEMPT, "3")
    monkeypatch.setenv(ENV_JOB_START, repr(time.time() - 3600.0))
    decisions = []
    for mtbf_hours in (None, 3):
        checkpoint = AsyncCheckpoint(tmp_path / f"ckpt-{mtbf_hours}", every_n_train_steps="auto", mtbf_hours=mtbf_hours)
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=FIRST_SAVE_STEPS + 1, callbacks=[checkpoint], logger=False,
                          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(BoringModel())  # the first save (step 20) measures the cost; its report decides the cadence
        decisions.append(checkpoint.decision)
    ledger, given = decisions
    assert ledger.mtbf_s == pytest.approx(1800.0, rel=0.01)  # 2 failures in the job's hour so far
    assert "ledger: 2 failure(s)" in ledger.mtbf_source
    assert (given.mtbf_s, given.mtbf_source) == (3 * 3600.0, "given")


def test_auto_saves_at_the_interval_it_computed_from_what_it_measured(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    proc = run_script(JOB, "--out", str(out), "--ckpt-dir", str(ckpt), "--every", "auto", "--mtbf-hours", "0.002",
                      "--max-steps", "120", "--width", "512", "--keep", "100", "--step-sleep", "0.01", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "AsyncCheckpoint(every_n_train_steps='auto'): every" in proc.stderr + proc.stdout
    summary = summarize_run_dir(out / "ett")
    decisions = summary.facts_named("checkpoint_cadence")
    assert decisions and all(d["mode"] == "auto" for d in decisions)
    for d in decisions:  # each logged choice is the formula applied to the measured numbers
        optimum = math.sqrt(2 * d["save_cost_s"] * d["mtbf_s"])
        assert d["mtbf_s"] == pytest.approx(7.2)
        if d["bound"] is None:
            assert d["interval_steps"] == max(1, round(optimum / d["step_s"]))
        assert d["expected_loss_per_failure_s"] == pytest.approx(d["interval_s"] / 2)
    # ... and the saves came at those intervals: the first after FIRST_SAVE_STEPS to measure, then as decided.
    steps = [e.step for e in fmt.committed(ckpt)]
    assert steps[0] == FIRST_SAVE_STEPS
    chosen = {d["interval_steps"] for d in decisions} | {FIRST_SAVE_STEPS}
    gaps = [b - a for a, b in itertools.pairwise(steps)][:-1]  # the last save is the end of fit
    assert gaps and all(g in chosen for g in gaps), (steps, chosen)
    report = run_script("-m", "lightning_ett.launch.cli", "report", str(out / "ett"))
    assert "of work on average" in report.stdout, report.stdout + report.stderr  # (an MTBF given)


def test_auto_rejects_bad_policy_inputs(tmp_path):
    with pytest.raises(ValueError, match="mtbf_hours=-1"):
        AsyncCheckpoint(tmp_path, every_n_train_steps="auto", mtbf_hours=-1)
    with pytest.raises(ValueError, match="every_n_train_steps='sometimes'"):
        AsyncCheckpoint(tmp_path, every_n_train_steps="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_interval_minutes=0"):
        AsyncCheckpoint(tmp_path, every_n_train_steps="auto", max_interval_minutes=0)


def test_the_cadence_line_predicts_a_failure_cost_only_from_failures_seen_or_an_mtbf_given():
    healthy = CadenceDecision(100, 6.7, 0.014, *estimate_mtbf_s(0, 60.0), 0.067, None)  # a young job, no failure
    line = cadence_line({"mode": "fixed", **healthy.to_fields()})
    assert line.startswith("every 100 steps (~6.7s, fixed); a save blocks training 0.014s (0.21% of the interval)")
    assert "no failure seen yet" in line and "training time" not in line  # no 48 % from an assumed MTBF
    failed = CadenceDecision(100, 6.7, 0.014, *estimate_mtbf_s(2, 3600.0), 0.067, None)
    line = cadence_line({"mode": "fixed", **failed.to_fields()})
    assert "a failure at MTBF 0.5h [ledger: 2 failure(s) in 1.00 h] loses ~3.4s of work on average" in line
    assert f"saves and lost work {100 * failed.predicted_overhead:.2f}% of training time" in line
    given = CadenceDecision(329, 6.6, 0.364, 60.0, "given", 0.02, None)
    line = cadence_line({"mode": "auto", **given.to_fields()})
    assert "auto: sqrt(2 x save cost x MTBF 0.0167h [given])" in line and "of training time" in line
