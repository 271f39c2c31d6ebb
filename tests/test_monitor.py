"""ETTMonitor on Lightning's BoringModel: real Trainer, real checkpoints, real ledger files."""

from __future__ import annotations

import csv
import json
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, run_script
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ett import ETTMonitor, summarize_run_dir
from lightning_ett.instrument.ledger import read_ledger


def test_phases_cover_the_process_wall_time_and_saves_and_eval_are_not_effective(tmp_path):
    run_dir = tmp_path / "run"
    started = time.time()
    proc = run_script(
        str(SCRIPTS / "boring_job.py"), "--run-dir", str(run_dir), "--ckpt-dir", str(tmp_path / "ckpt"),
        "--max-steps", "30", "--step-sleep", "0.02", "--save-every", "10", "--save-sleep", "0.3",
        "--val-every", "15", "--val-sleep", "0.1", "--exit-stamp", str(tmp_path / "exit_stamp"), fresh=True,
    )  # (fresh: the subject includes the process's own start, its imports)
    finished = time.time()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ETT" in proc.stdout  # the rich table printed at the end of fit

    s = summarize_run_dir(run_dir)
    # The ledger's clock agrees with an outside observer, from the process's start (the OS's,
    # 10 ms ticks) to its last exit handler. Only the interpreter's own teardown after that
    # (1.0-1.5 s with torch here, more on a loaded machine) is invisible from inside the process;
    # `lightning run` measures it.
    last_exit_handler = float((tmp_path / "exit_stamp").read_text())
    assert -0.05 < s.job_start - started < 0.5, (s.job_start, started)  # (the fork's lag; importing takes > 1 s)
    assert 0 <= last_exit_handler - s.job_end < 0.25, (s.job_end, last_exit_handler)
    assert last_exit_handler < finished
    assert sum(s.phases.values()) == pytest.approx(s.wall_s, rel=1e-6)
    assert s.phases["checkpoint_save"] >= 3 * 0.3  # saves at steps 10, 20, 30
    assert s.phases["eval"] >= 2 * 2 * 0.1  # 2 validations x 2 batches
    assert 30 * 0.02 <= s.effective_s < 30 * 0.02 + 1.5  # the sleeps above did not leak into train
    assert s.phases["import"] > 0.5 and s.phases["process_group_init"] > 0
    assert s.phases["shutdown"] > 0 and s.completed
    events = read_ledger(run_dir)[0].events
    assert sorted(e["step"] for e in events if e["phase"] == "train") == list(range(30))

    summary_json = json.loads((run_dir / "ett_summary.json").read_text())
    for key in ("ett_percent", "wall_s", "effective_s", "lost_s", "attempts", "phases"):
        assert key in summary_json
    assert (run_dir / "ett_report.png").stat().st_size > 10_000


def test_monitor_logs_to_any_logger_without_wandb_installed(tmp_path):
    proc = run_script(
        str(SCRIPTS / "boring_job.py"), "--run-dir", str(tmp_path / "run"), "--csv-dir", str(tmp_path / "csv"),
        "--max-steps", "12", "--block-wandb",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics_csv,) = Path(tmp_path / "csv").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics_csv.open()))
    logged = [r for r in rows if r.get("ett/percent")]
    assert [int(r["step"]) for r in logged][:2] == [5, 10]  # every log_every_n_steps=5, then the final row
    final = logged[-1]
    assert 0 < float(final["ett/percent"]) < 100
    assert float(final["ett/train_s"]) > 0 and float(final["ett/import_s"]) > 0


def test_unwritable_run_dir_fails_at_setup_naming_the_path(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    bad = blocker / "run"
    trainer = Trainer(max_steps=1, callbacks=[ETTMonitor(run_dir=bad)], logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False)
    with pytest.raises(PermissionError, match=str(bad)):
        trainer.fit(BoringModel())


@pytest.mark.parametrize("value", [0, -5, 2.5, True, "10"])
def test_bad_log_interval_is_rejected_naming_the_argument(value):
    with pytest.raises(ValueError, match="log_every_n_steps"):
        ETTMonitor(log_every_n_steps=value)


def test_state_survives_resume_and_warns_on_foreign_job(tmp_path, monkeypatch):
    first = ETTMonitor(run_dir=tmp_path / "a")
    state = first.state_dict()
    assert state["job_id"] == first.context.job_id and state["job_start"] == first.context.job_start
    same_job = ETTMonitor(run_dir=tmp_path / "a")  # the env exported by `first` makes it the same job
    earlier = dict(state, job_start=state["job_start"] - 100.0)
    same_job.load_state_dict(earlier)
    assert same_job.context.job_start == earlier["job_start"]
    foreign = dict(state, job_id="someone-else", run_dir=str(tmp_path / "elsewhere"))
    with pytest.warns(UserWarning, match="begins from a checkpoint of ETT job 'someone-else'.*If this is a restart"):
        same_job.load_state_dict(foreign)
    # Under `lightning run` a restart is in the job's own run dir: another job's checkpoint is a new job begun from it
    # (a fine-tune), said once as information, with no advice to pass another run_dir (a new-user trial, helper 67).
    monkeypatch.setenv("LIGHTNING_ETT_LAUNCHER", "lightning run")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        same_job.load_state_dict(foreign)
    assert not [w for w in seen if "ETT job" in str(w.message)]


def test_a_second_job_in_the_same_process_does_not_inherit_the_first(tmp_path):
    first = ETTMonitor(run_dir=tmp_path / "a")
    again = ETTMonitor(run_dir=tmp_path / "a")  # same run dir: same job (fit, then test, in one script)
    other = ETTMonitor(run_dir=tmp_path / "b")  # another run dir: another job, its own attempt count
    assert again.context.job_id == first.context.job_id
    assert other.context.job_id != first.context.job_id and other.run_dir == (tmp_path / "b").absolute()


def test_monitor_pickles_for_spawn_based_launchers(tmp_path):
    import pickle

    monitor = ETTMonitor(run_dir=tmp_path)
    clone = pickle.loads(pickle.dumps(monitor))
    assert clone.run_dir == monitor.run_dir and clone.state_dict() == monitor.state_dict()


class CompiledBoring(BoringModel):
    """The user's own torch.compile, no lightning-ett compile callback in sight."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.compile(self.layer, backend="eager")


def test_a_users_own_torch_compile_is_counted_as_compile_not_train(tmp_path):
    trainer = Trainer(max_steps=3, callbacks=[ETTMonitor(run_dir=tmp_path / "run", report_on_end=False)], logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, limit_val_batches=0, accelerator="cpu")
    trainer.fit(CompiledBoring())
    (ledger,) = read_ledger(tmp_path / "run")
    compiles = [e for e in ledger.events if e["phase"] == "compile"]
    first_step = next(e for e in ledger.events if e["phase"] == "train")
    assert compiles and first_step["start"] <= compiles[0]["start"] <= compiles[0]["end"] <= first_step["end"]
    assert summarize_run_dir(tmp_path / "run").phases["compile"] > 0


def test_another_jobs_checkpoint_is_called_a_restart_only_when_fit_resumes_from_it(tmp_path):
    def trainer(run: str) -> Trainer:
        return Trainer(default_root_dir=tmp_path, max_steps=2, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, limit_val_batches=2, num_sanity_val_steps=0,
                       callbacks=[ETTMonitor(run_dir=tmp_path / run, report_on_end=False)])

    first = trainer("first")
    first.fit(BoringModel())
    first.save_checkpoint(tmp_path / "first.ckpt")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer("second").validate(BoringModel(), ckpt_path=tmp_path / "first.ckpt")  # a validation: no restart
    assert not [w for w in seen if "begins from a checkpoint of ETT job" in str(w.message)]
    with pytest.warns(UserWarning, match="begins from a checkpoint of ETT job .* count it as another attempt"):
        trainer("third").fit(BoringModel(), ckpt_path=tmp_path / "first.ckpt")
