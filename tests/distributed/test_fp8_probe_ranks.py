"""FP8Probe on 2 real gloo ranks: each rank samples its own data; one all-gather combines their windows."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SCRIPTS, launch

from lightning_ett import summarize_run_dir
from lightning_ett.fp8.stats import decide

JOB = str(SCRIPTS / "fp8_job.py")


def merged(ranks: list[dict], fqn: str) -> list[tuple[int, float]]:
    """Every rank's windows of a layer, by hand: one window seen on both ranks is one observation, at its worst."""
    windows: dict[int, float] = {}
    for rank in ranks:
        for window, value in rank["windows"][fqn]:
            windows[window] = min(windows.get(window, value), value)
    return sorted(windows.items())


def check_combined(ranks: list[dict]) -> dict:
    assert ranks[0]["results"] == ranks[1]["results"]  # every rank holds the combined verdict
    results = ranks[0]["results"]
    for fqn, result in results.items():
        series = merged(ranks, fqn)
        assert all(r["windows"][fqn] for r in ranks) and result["samples"] == len(series)
        expected = decide(series, ranks[0]["threshold"], ranks[0]["tail"], ranks[0]["confidence"])
        assert result["verdict"] == expected.verdict and result["bad_windows"] == expected.bad_windows, (fqn, result)
        assert result["sqnr_db_worst"] == min(v for _, v in series)
    return results


def test_under_ettstrategy_the_dlrm_dense_layers_are_combined_window_by_window(tmp_path):
    proc = launch(JOB, "dlrm", "--devices", "2", "--steps", "60", "--out", str(tmp_path), "--run-dir", str(tmp_path / "run"),
                  run_dir=tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = check_combined([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)])
    # The DLRM's dense MLPs are probed; its (sharded) embedding tables are not Linear layers.
    assert sorted(results) == ["model.dense_arch.model._mlp.0._linear", "model.dense_arch.model._mlp.1._linear",
                               "model.over_arch.model.0._mlp.0._linear", "model.over_arch.model.0._mlp.1._linear",
                               "model.over_arch.model.1"]
    assert not any(r["eligible"] for r in results.values())  # all far below torchao's FP8 sizes
    (fact,) = summarize_run_dir(tmp_path / "run").facts_named("fp8_probe")  # rank 0 states it once
    assert fact["layers"] == 5 and fact["safe_and_eligible"] == 0


@pytest.mark.parametrize("strategy", ["ddp", "ett"])
def test_under_bf16_mixed_a_users_configure_model_and_frozen_layers_are_probed(strategy, tmp_path):
    """Lightning runs the callbacks' setup before configure_model: the probe finds the layers at fit start, under DDP
    and under ETTStrategy alike."""
    proc = launch(JOB, "user", "--devices", "2", "--strategy", strategy, "--precision", "bf16-mixed", "--steps", "60",
                  "--probe-args", json.dumps({"every_n_steps": 5, "max_overhead": 0.9}), "--out", str(tmp_path),
                  run_dir=tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = check_combined([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)])
    assert sorted(results) == ["body.0", "body.2", "body.4", "proj"]
    assert results["proj"]["measured_gemms"] == ["output"]


def test_a_resumed_run_goes_on_from_every_ranks_windows(tmp_path):
    """Lightning writes rank 0's callback state; the probe puts the whole job's windows there, so rank 1's
    windows from before the checkpoint still count after a resume."""
    probe_args = json.dumps({"every_n_steps": 5, "max_overhead": 0.9})
    common = ("user", "--devices", "2", "--strategy", "ddp", "--probe-args", probe_args)
    first, second = tmp_path / "first", tmp_path / "second"
    proc = launch(JOB, *common, "--steps", "30", "--out", str(first), "--save", str(tmp_path / "step30.ckpt"),
                  run_dir=tmp_path / "run1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = launch(JOB, *common, "--steps", "60", "--out", str(second), "--resume", str(tmp_path / "step30.ckpt"),
                  run_dir=tmp_path / "run2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    before = [json.loads((first / f"rank{r}.json").read_text()) for r in range(2)]
    after = [json.loads((second / f"rank{r}.json").read_text()) for r in range(2)]
    differs = [f for f in after[0]["results"] if merged(before, f) != sorted(map(tuple, before[0]["windows"][f]))]
    assert differs  # rank 1's windows were worse than rank 0's somewhere: keeping only rank 0's would show
    for fqn, result in after[0]["results"].items():
        job_before = merged(before, fqn)
        carried = [w for w in map(tuple, after[0]["windows"][fqn]) if w[0] < 6]  # rank 0 carries the job's windows on
        assert carried == job_before, fqn
        assert all(w[0] >= 6 for w in after[1]["windows"][fqn])  # ... rank 1 reports only its own, new ones
        series = merged(before + after, fqn)
        assert result["samples"] == len(series) and result["sqnr_db_worst"] == min(v for _, v in series), fqn


def test_a_save_in_an_exceptions_wake_on_one_rank_is_written_not_held_in_the_probes_gather(tmp_path):
    """OnExceptionCheckpoint saves on the rank that failed only: the probe's checkpoint gather must not run there."""
    proc = launch(str(SCRIPTS / "fp8_exception_job.py"), "--out", str(tmp_path), run_dir=tmp_path / "run", timeout=180)
    assert proc.returncode != 0 and "a failure on rank 0 alone" in proc.stderr, proc.stderr[-4000:]
    saved = torch.load(tmp_path / "on-exception.ckpt", weights_only=False)
    (state,) = [v for k, v in saved["callbacks"].items() if k.startswith("FP8Probe")]
    assert state["records"] and any(any(v) for v in state["records"].values())  # rank 0's windows, written
