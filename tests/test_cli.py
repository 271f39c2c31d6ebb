from __future__ import annotations

import json

from conftest import run_script
from lightning_ett import get_timeline


def test_report_writes_table_json_and_png_for_a_running_job(tmp_path):
    tl = get_timeline()
    tl.bind(tmp_path, rank=0, attempt=0, header={"job_start": 100.0})
    tl.record("import", 100.0, 101.0)
    tl.record("train", 101.0, 104.0, step=0)
    tl.close()
    proc = run_script("-m", "lightning_ett.cli", "report", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "ETT 75.0% of 4.0s wall" in proc.stdout and "running" in proc.stdout
    summary = json.loads((tmp_path / "ett_summary.json").read_text())
    assert summary["ett_percent"] == 75.0 and summary["attempts"] == 1 and summary["phases"]["import"] == 1.0
    assert (tmp_path / "ett_report.png").read_bytes()[:4] == b"\x89PNG"


def test_report_on_a_directory_without_ledger_is_a_clear_error(tmp_path):
    proc = run_script("-m", "lightning_ett.cli", "report", str(tmp_path))
    assert proc.returncode == 2 and "No ETT ledger" in proc.stderr
    proc = run_script("-m", "lightning_ett.cli", "report", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "is not a directory" in proc.stderr
