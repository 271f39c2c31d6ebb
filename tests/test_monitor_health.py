"""ETTMonitor's step-time health and straggler switches on one rank, in process (the 2-rank diagnosis:
tests/distributed/test_stragglers.py)."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ett import ETTMonitor
from lightning_ett.instrument.ledger import read_ledger
from lightning_ett.instrument.summary import summarize_run_dir
from lightning_ett.instrument.timeline import STRAGGLER_FACT
from lightning_ett.lifecycle.faults import ENV_FAULT_SLOW


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"straggler_every_n_steps": -1}, "straggler_every_n_steps"),
    ({"straggler_every_n_steps": 2.5}, "straggler_every_n_steps"),
    ({"straggler_every_n_steps": True}, "straggler_every_n_steps"),
    ({"straggler_threshold": 0}, "straggler_threshold"),
    ({"straggler_threshold": -0.1}, "straggler_threshold"),
    ({"straggler_threshold": float("nan")}, "straggler_threshold"),
    ({"straggler_threshold": "10%"}, "straggler_threshold"),
])
def test_bad_straggler_arguments_are_rejected_naming_the_argument(tmp_path, kwargs, named):
    with pytest.raises(ValueError, match=rf"ETTMonitor\({named}=.*expected"):
        ETTMonitor(run_dir=tmp_path, **kwargs)


class SavesAtStep5(BoringModel):
    """Saves a checkpoint from inside step 5: that step has a `checkpoint_save` nested in it."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.trainer.global_step == 5:
            self.trainer.save_checkpoint(self.trainer.default_root_dir + "/inside.ckpt")
        return super().training_step(batch, batch_idx)


def _fit(tmp_path, steps: int = 12, model: BoringModel | None = None) -> tuple[ETTMonitor, Trainer, BoringModel]:
    monitor = ETTMonitor(run_dir=tmp_path / "run", report_on_end=False)
    trainer = Trainer(max_steps=steps, callbacks=[monitor], logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
                      default_root_dir=str(tmp_path))
    model = model or BoringModel()
    trainer.fit(model)
    return monitor, trainer, model


def test_one_rank_logs_step_health_without_the_step_that_saved_and_runs_no_straggler_gather(tmp_path):
    monitor, _, _ = _fit(tmp_path, model=SavesAtStep5())
    metrics = monitor.live_metrics()
    assert metrics["ett/ideal_step_s"] > 0 and metrics["ett/step_time_deviation"] >= 0
    assert all(0 < metrics[f"ett/interval_percent_{w}"] <= 100 for w in ("5m", "15m", "60m"))  # the job: this process
    assert "ett/straggler_rank" not in metrics  # a single rank waits for no one
    assert not [f for lg in read_ledger(tmp_path / "run") for f in lg.facts if f["name"] == STRAGGLER_FACT]
    # Live, a step is judged when the next begins (the last one never is): 11 judged, step 5 not clean.
    assert (monitor._health.steps, monitor._health.clean_steps) == (11, 10)
    health = summarize_run_dir(tmp_path / "run").step_health
    assert (health["steps"], health["clean_steps"]) == (12, 11)  # from the ledger: the save is inside step 5
    assert health["ideal_step_s"] == pytest.approx(metrics["ett/ideal_step_s"], rel=0.5)


@pytest.mark.parametrize("where", ["data", "compute"])
def test_the_slow_fault_slows_its_rank_where_it_says_and_is_undone(tmp_path, monkeypatch, where):
    monkeypatch.setenv(ENV_FAULT_SLOW, f"0:0.03:{where}")
    _, trainer, model = _fit(tmp_path, steps=6)
    steps = sorted((e for lg in read_ledger(tmp_path / "run") for e in lg.events if e["phase"] == "train"),
                   key=lambda e: e["step"])
    # The first batch's fetch is data_init; every later step holds one slowed fetch, or one slowed forward.
    slowed = steps[1:] if where == "data" else steps
    assert all(e["end"] - e["start"] >= 0.03 for e in slowed), [round(e["end"] - e["start"], 4) for e in steps]
    assert "training_step" not in vars(model) and "_on_after_fetch" not in vars(trainer.fit_loop.epoch_loop)


def test_the_slow_fault_on_another_rank_leaves_this_one_alone(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_FAULT_SLOW, "1:0.5")
    _, _, _ = _fit(tmp_path, steps=4)
    steps = [e for lg in read_ledger(tmp_path / "run") for e in lg.events if e["phase"] == "train"]
    assert all(e["end"] - e["start"] < 0.25 for e in steps)
