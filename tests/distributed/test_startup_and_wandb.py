"""Start-up phases named after their owner, and one W&B run per job, under `lightning run` (real gloo ranks)."""

from __future__ import annotations

from pathlib import Path

from conftest import SCRIPTS, lightning_run
from helpers.wandb_records import history_rows, read_records, summary_values

from lightning_ett import summarize_run_dir
from lightning_ett.instrument.ledger import read_ledger

JOB = str(SCRIPTS / "logger_job.py")


def test_a_slow_logger_start_is_logger_init_not_process_group_init(tmp_path):
    proc = lightning_run("--devices", "2", "--max-restarts", "0", "--run-dir", str(tmp_path / "run"), JOB,
                         "--ckpt-dir", str(tmp_path / "ckpt"), "--max-steps", "4", "--slow-logger", "6")
    assert proc.returncode == 0, proc.stderr[-4000:]
    per_rank = summarize_run_dir(tmp_path / "run").per_rank
    # Rank 0 creates the experiment (rank_zero_experiment): its 6 s are logger_init, less only what
    # the start-up work it overlapped hid (that share grows with host load, so they are bounded
    # together); the process group keeps just its own time on every rank, rendezvous waits for a
    # slower peer included (6 s against 3: the logger's sleep is far above that noise).
    assert 3.0 <= per_rank[0]["logger_init"] <= 7.5, per_rank[0]
    overlapped = sum(per_rank[0][p] for p in ("logger_init", "process_group_init", "sharding_plan"))
    assert overlapped >= 5.8, per_rank[0]
    for rank in (0, 1):
        assert per_rank[rank]["process_group_init"] < 3.0, per_rank[rank]
        assert per_rank[rank]["trainer_init"] > 0, per_rank[rank]
    # The logger ran in the background, overlapping the process group: both spans share wall time.
    events = next(lg for lg in read_ledger(tmp_path / "run") if lg.rank == 0).events
    logger = next(e for e in events if e["phase"] == "logger_init")
    group = [e for e in events if e["phase"] == "process_group_init"]
    assert any(e["start"] < logger["end"] and logger["start"] < e["end"] for e in group)


def _offline_runs(save_dir: Path) -> list[tuple[str, Path]]:
    """(run id, run file) of every offline W&B run under ``save_dir``, oldest first."""
    runs = []
    for path in sorted(save_dir.glob("wandb/offline-run-*/run-*.wandb")):
        record = next(r for r in read_records(path) if r.WhichOneof("record_type") == "run")
        runs.append((record.run.run_id, path))
    return runs


def test_two_attempts_of_a_job_write_one_wandb_run_whose_ett_history_never_steps_back(tmp_path):
    # Rank 0, the one that writes to W&B, is SIGKILLed: what it logged before must survive
    # (the launcher's W&B service outlives it).
    proc = lightning_run("--devices", "2", "--max-restarts", "1", "--run-dir", str(tmp_path / "run"), JOB,
                         "--ckpt-dir", str(tmp_path / "ckpt"), "--max-steps", "20", "--every", "5",
                         "--wandb-dir", str(tmp_path), LIGHTNING_ETT_FAULT_KILL="0:12:0")
    assert proc.returncode == 0, proc.stderr[-4000:]
    job = summarize_run_dir(tmp_path / "run")
    assert len(job.attempts) == 2 and job.lost_s > 0  # the restart resumed from step 10 and re-ran steps

    runs = _offline_runs(tmp_path)
    assert len(runs) == 2, runs  # one offline directory per attempt ...
    assert len({run_id for run_id, _ in runs}) == 1  # ... both of the same run
    steps = []
    for _, path in runs:
        rows = [r for r in history_rows(path) if "ett/percent" in r]
        assert rows, path  # each attempt continued the charts, the killed one included
        steps += [r["trainer/global_step"] for r in rows]
    assert steps == sorted(steps), steps  # no ett/* point steps back, though steps 11-12 ran twice
    assert steps[-1] == 20

    summary = summary_values(runs[-1][1])
    assert summary["ett/attempts"] == 2
    assert summary["ett/lost_s"] > 0
    assert abs(summary["ett/effective_s"] - job.effective_s) < 0.05
    assert summary["ett/logger_init_s"] > 0 and 0 < summary["ett/percent"] < 100
