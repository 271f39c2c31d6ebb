"""The straggler diagnosis on real gloo ranks: an injected slow rank is named; a clean run names no one."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import SCRIPTS, lightning_run, run_script
from helpers.wandb_records import find_run_file, history_rows, summary_values

from lightning_ett.instrument.ledger import read_launcher_records, read_ledger
from lightning_ett.instrument.timeline import STRAGGLER_FACT

JOB = str(SCRIPTS / "straggler_job.py")
DELAY_S = 0.05


@pytest.mark.parametrize(("side", "logger"), [("data", "csv"), ("compute", "wandb")])
def test_an_injected_slow_rank_is_named_the_straggler_within_100_steps(tmp_path: Path, side: str, logger: str) -> None:
    run_dir = tmp_path / "run"
    # Lightning's own DDP launcher starts rank 1 (the cheapest real 2-rank job); it inherits the fault switch.
    proc = run_script(JOB, "--out", str(tmp_path / "out"), "--run-dir", str(run_dir), "--max-steps", "100",
                      f"--{logger}-dir", str(tmp_path / logger), timeout=180, LIGHTNING_ETT_FAULT_SLOW=f"1:{DELAY_S}:{side}")
    assert proc.returncode == 0, proc.stderr[-4000:]

    facts = [f for lg in read_ledger(run_dir) for f in lg.facts if f["name"] == STRAGGLER_FACT]
    assert facts and all(f["rank"] == 0 for f in facts)  # rank 0 records the windows
    assert [f["step"] for f in facts] == [50, 75]  # 25 steps a window; the first (at 25) only set the origin
    for f in facts:
        assert f["straggler"] == 1 and f["side"] == side, f
        assert DELAY_S * 0.9 < f["scores"][1] < DELAY_S * 1.3 and f["scores"][0] < 0.002, f
    assert "rank 1 is a straggler" in proc.stderr  # two windows in a row: warned

    summary = json.loads((run_dir / "ett_summary.json").read_text())
    assert summary["stragglers"]["worst"]["rank"] == 1 and summary["stragglers"]["named"] == {"1": 2}
    assert "straggler: rank 1, others waited" in proc.stdout and f"({side} side)" in proc.stdout  # the report's line
    health = summary["step_health"]
    assert health["ideal_step_s"] > DELAY_S and health["clean_steps"] >= 90  # the waiting is slow training
    if logger == "csv":  # every logger gets the live figures
        (metrics_csv,) = (tmp_path / "csv").rglob("metrics.csv")
        rows = [r for r in csv.DictReader(metrics_csv.open()) if r.get("ett/straggler_rank")]
        assert rows and float(rows[-1]["ett/straggler_rank"]) == 1.0
        assert float(rows[-1]["ett/ideal_step_s"]) > DELAY_S and 0 < float(rows[-1]["ett/interval_percent_5m"]) <= 100
    else:  # W&B also gets the per-rank table and the straggler in the run's summary
        run_file = find_run_file(tmp_path / "wandb")
        rows = history_rows(run_file)
        assert [r["ett/straggler_rank"] for r in rows if "ett/straggler_rank" in r][-1] == 1.0
        assert any(r.get("ett/straggler_table/_type") == "table-file" and r.get("ett/straggler_table/nrows") == 2
                   for r in rows)
        final = summary_values(run_file)
        assert final["ett/straggler_rank"] == 1 and final["ett/ideal_step_s"] > DELAY_S
        assert 0 < final["ett/interval_percent_60m"] <= 100


@pytest.mark.parametrize("slow_rank", [None, 1], ids=["clean", "rank-1-reads-slowly"])
def test_under_the_input_pipeline_a_slow_reader_is_named_on_the_data_side_and_a_clean_run_names_no_one(
        tmp_path: Path, slow_rank: int | None) -> None:
    """ETTStrategy reads the next batch inside the step, before the forward's first collective, which absorbed
    a slow reader's lateness: the strategy marks the read's end (instrument.step_marks)."""
    run_dir = tmp_path / "run"
    slow = ["--slow-rank", str(slow_rank)] if slow_rank is not None else []
    proc = lightning_run("--devices", "2", "--max-restarts", "0", "--run-dir", str(run_dir),
                         str(SCRIPTS / "straggler_pipeline_job.py"), "--max-steps", "100", *slow, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    facts = [f for lg in read_ledger(run_dir) for f in lg.facts if f["name"] == STRAGGLER_FACT]
    assert [f["step"] for f in facts] == [50, 75]
    if slow_rank is None:
        assert max(f["streak"] for f in facts) < 2 and "straggler" not in proc.stderr.lower(), facts
        return
    for f in facts:
        assert f["straggler"] == 1 and f["side"] == "data", f
        assert DELAY_S * 0.9 < f["scores"][1] < DELAY_S * 1.3 and f["scores"][0] < 0.002, f
    assert "rank 1 is a straggler" in proc.stderr


def test_a_clean_run_under_lightning_run_names_no_straggler_and_no_hang(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = lightning_run("--devices", "2", "--max-restarts", "0", "--run-dir", str(run_dir), JOB,
                         "--out", str(tmp_path / "out"), "--max-steps", "320", timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "straggler" not in proc.stderr.lower() and "straggler" not in proc.stdout.lower()
    assert not [r for r in read_launcher_records(run_dir) if r["kind"] == "failure"]  # the hang watch stayed quiet

    summary = json.loads((run_dir / "ett_summary.json").read_text())
    assert summary["outcome"] == "finished"
    assert summary["stragglers"]["windows"] == 11  # steps 50, 75, ..., 300: every window was judged
    facts = [f for lg in read_ledger(run_dir) for f in lg.facts if f["name"] == STRAGGLER_FACT]
    assert max(f["streak"] for f in facts) < 2  # one noisy window may cross the 3 ms floor; two in a row would warn
    worst = max(max(f["scores"]) for f in facts)
    print(f"clean run: highest window score {1000 * worst:.2f} ms (threshold {1000 * facts[-1]['threshold_s']:.1f} ms)")
