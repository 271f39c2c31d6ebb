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
    proc = run_script("-m", "lightning_ett.launch.cli", "report", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "ETT 75.0% of 4.0s wall" in proc.stdout and "running" in proc.stdout
    summary = json.loads((tmp_path / "ett_summary.json").read_text())
    assert summary["ett_percent"] == 75.0 and summary["attempts"] == 1 and summary["phases"]["import"] == 1.0
    assert (tmp_path / "ett_report.png").read_bytes()[:4] == b"\x89PNG"


def test_report_on_a_directory_without_ledger_is_a_clear_error(tmp_path):
    proc = run_script("-m", "lightning_ett.launch.cli", "report", str(tmp_path))
    assert proc.returncode == 2 and "No ETT ledger" in proc.stderr
    proc = run_script("-m", "lightning_ett.launch.cli", "report", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "is not a directory" in proc.stderr


def test_report_now_on_a_running_job_counts_wall_time_up_to_now(tmp_path):
    import subprocess
    import sys
    import time

    from conftest import SCRIPTS, clean_env

    from lightning_ett.instrument.ledger import read_ledger

    run = tmp_path / "run"
    job = subprocess.Popen([sys.executable, str(SCRIPTS / "boring_job.py"), "--run-dir", str(run), "--max-steps", "2000",
                            "--step-sleep", "0.02"], env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # until the job has trained a few steps
            if run.joinpath("ledger").is_dir() and sum(e["phase"] == "train" for lg in read_ledger(run) for e in lg.events) >= 5:
                break
            time.sleep(0.2)
        before = time.time()
        proc = run_script("-m", "lightning_ett.launch.cli", "report", "--now", str(run))
        after = time.time()
        assert job.poll() is None, "the job should still be running"
    finally:
        job.kill()
        job.wait()
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "ett_summary.json").read_text())
    assert before <= summary["job_end"] <= after  # wall time up to the moment of the report, not the last event
    assert summary["phases"]["train"] > 0 and summary["completed"] is False
    assert "running or failed" in " ".join(proc.stdout.split())
