"""Two attempts of one job: the first SIGKILLed mid-training, the second resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from conftest import SCRIPTS, clean_env, run_script

from lightning_ett import summarize_run_dir
from lightning_ett.instrument.ledger import read_ledger


def _wait_for_step(ledger_file, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the job ended before it could be killed"
        if ledger_file.exists():
            for line in ledger_file.read_text().splitlines():
                record = json.loads(line)
                if record.get("phase") == "train" and record.get("step", -1) >= step:
                    return
        time.sleep(0.05)
    raise TimeoutError(f"step {step} never appeared in {ledger_file}")


def test_sigkilled_attempt_is_counted_and_its_repeated_steps_are_lost(tmp_path):
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "ckpt"
    args = [str(SCRIPTS / "boring_job.py"), "--run-dir", str(run_dir), "--ckpt-dir", str(ckpt_dir),
            "--max-steps", "30", "--step-sleep", "0.05", "--save-every", "10"]
    first = subprocess.Popen([sys.executable, *args], env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_for_step(run_dir / "ledger" / "attempt-0000" / "rank-00000.jsonl", 14, first)
        os.kill(first.pid, signal.SIGKILL)
    finally:
        first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL

    killed = read_ledger(run_dir)
    assert len(killed) == 1 and killed[0].status is None  # readable, and not marked finished
    killed_steps = [e["step"] for e in killed[0].events if e["phase"] == "train"]
    assert max(killed_steps) >= 14

    second = run_script(*args, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "begins from a checkpoint of ETT job" not in second.stderr  # job.json in the run dir links the restart to the job

    s = summarize_run_dir(run_dir)
    assert len(s.attempts) == 2
    assert s.attempts[0].completed is False and s.attempts[1].completed is True
    assert s.attempts[1].first_step == 10  # resumed from the step-10 checkpoint
    lost_steps = [step for step in killed_steps if step >= 10]
    assert s.lost_s > 0.05 * len(lost_steps)  # every re-run step cost at least its sleep
    assert s.phases["checkpoint_load"] > 0
    assert s.phases["launch"] > 0  # restart downtime between the kill and the second process
    assert sum(s.phases.values()) - s.wall_s < 1e-6
