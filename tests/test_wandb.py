"""ETTMonitor -> WandbLogger (offline): read back what the run file really holds."""

from __future__ import annotations

from conftest import SCRIPTS, run_script
from helpers.wandb_records import find_run_file, history_rows, summary_values

from lightning_ett import summarize_run_dir


def test_offline_wandb_run_holds_ett_percent_over_time_and_the_phase_breakdown(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_script(
        str(SCRIPTS / "boring_job.py"), "--run-dir", str(run_dir), "--wandb-dir", str(tmp_path),
        "--max-steps", "15", "--step-sleep", "0.01",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = history_rows(find_run_file(tmp_path))

    percent = [(r["trainer/global_step"], r["ett/percent"]) for r in rows if "ett/percent" in r]
    assert [step for step, _ in percent[:3]] == [5, 10, 15]  # a time series, not just one value
    assert all(0 < value < 100 for _, value in percent)
    final = [r for r in rows if "ett/percent" in r][-1]
    for phase in ("train", "import", "process_group_init", "model_init", "data_init"):
        assert final[f"ett/{phase}_s"] > 0, phase

    # The same numbers the ledger gives at the time of the final log (it grows by shutdown later).
    ledger_summary = summarize_run_dir(run_dir)
    assert abs(final["ett/train_s"] - ledger_summary.effective_s) < 0.05

    tables = [r for r in rows if r.get("ett/phase_table/_type") == "table-file"]
    assert tables and tables[-1]["ett/phase_table/ncols"] == 3
    assert any(r.get("ett/phase_breakdown_table/_type") == "table-file" for r in rows)  # the bar chart's data
    assert any(r.get("ett/timeline/_type") == "image-file" for r in rows)

    summary = summary_values(find_run_file(tmp_path))
    assert summary["ett/percent"] == final["ett/percent"] and summary["ett/attempts"] == 1
