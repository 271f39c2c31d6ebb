"""FP8Probe on a model with a planted FP8-sensitive layer: verdicts, budget, emulated FP8 training, outputs, bad input."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, run_script
from helpers.wandb_records import find_run_file, history_rows, summary_values
from lightning.pytorch import Trainer

from lightning_ett import FP8Probe, summarize_run_dir
from lightning_ett.fp8.cast import Gemm, Recipe, cast, fp8_mm, sqnr_db
from lightning_ett.fp8.stats import RunningStats

JOB = str(SCRIPTS / "fp8_job.py")
ORDINARY = ("mid", "wide", "head")


def job(*args: str, timeout: float = 300) -> dict:
    out = Path(args[args.index("--out") + 1])
    proc = run_script(JOB, *args, timeout=timeout, cwd=out)  # a Trainer's default_root_dir is its cwd: not the repo
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """The planted model trained 3000 steps with FP8Probe() at its defaults, ETTMonitor and a WandbLogger (offline)."""
    out = tmp_path_factory.mktemp("fp8-probe")
    return job("probe", "--out", str(out), "--run-dir", str(out / "run"), "--wandb-dir", str(out)), out


def test_the_planted_layer_is_unsafe_and_the_ordinary_ones_safe_within_the_default_budget(probed):
    result, _ = probed
    layers = result["results"]
    assert sorted(layers) == sorted(("planted", *ORDINARY))
    assert layers["planted"]["verdict"] == "unsafe", layers["planted"]
    assert layers["planted"]["sqnr_db_high"] < 20.0 and layers["planted"]["flushed_share"]["input"] > 0.1
    for fqn in ORDINARY:
        assert layers[fqn]["verdict"] == "safe", (fqn, layers[fqn])
        assert layers[fqn]["sqnr_db_low"] >= 20.0 and layers[fqn]["flushed_share"]["input"] < 0.01
    assert layers["planted"]["amax"]["input"] > 5e4  # the outliers' magnitude, seen in the real input
    for layer in layers.values():  # both recipes, all three GEMMs measured
        assert set(layer["gemms"]) == {"tensorwise", "rowwise"}
        assert all(set(g) == {"output", "grad_input", "grad_weight"} for g in layer["gemms"].values())
        assert layer["samples"] >= 2 and layer["kernel"] == "scaled_mm"  # torch 2.13 has _scaled_mm on CPU
    # Eligibility is torchao's: 64 -> 1040 passes its tensorwise rules, 1040 -> 64 and 1040 -> 1 do not.
    assert [f for f, r in layers.items() if r["eligible"]] == ["planted", "wide"]
    assert abs(sum(r["flop_share"] for r in layers.values()) - 1) < 1e-9
    assert result["summary_line"] == "FP8-safe and eligible: 1 of 4 layers, 33.2% of GEMM FLOPs"
    assert result["selected"] == ["wide"] and result["converted"] == ["wide"]  # torchao converts what the filter selects


def test_the_probe_stays_within_its_overhead_budget(probed):
    result, _ = probed
    assert 0 < result["overhead"] <= 0.02 * 1.5, result["overhead"]  # its own timers: hooks and GEMMs
    # The same cost from the training loop's own step clock: the sampled steps' extra time over a typical step.
    # (A whole loop with / without the probe moves by +-15 % between identical runs on this 2-core VM; that
    # comparison, over alternating rounds, is benchmarks/fp8_probe.py's.)
    steps, sampled = result["step_s_with"], set(result["sampled_steps"])
    # How many samples the run takes is the machine's: the gap after each grows with its cost over a step's, and
    # sampling stops once every layer is decided (CI once decided all four after 2). Two give the step clock a check.
    assert len(sampled) == result["samples_taken"] >= 2
    typical = statistics.median(s for i, s in enumerate(steps) if i not in sampled)
    extra = sum(steps[i] - typical for i in sampled)
    assert extra / sum(steps) <= 0.02 * 1.5, extra / sum(steps)


def test_the_results_go_to_the_run_dir_the_report_and_wandb(probed):
    result, out = probed
    written = json.loads((out / "run" / "fp8_probe.json").read_text())
    assert written["layers"] == result["results"] and written["summary"] == result["summary_line"]
    (fact,) = summarize_run_dir(out / "run").facts_named("fp8_probe")
    assert (fact["safe_and_eligible"], fact["layers"], fact["unsafe"], fact["undecided"]) == (1, 4, 1, 0)
    run_file = find_run_file(out)
    assert any(row.get("fp8/probe/_type") == "table-file" and row.get("fp8/probe/nrows") == 4 for row in history_rows(run_file))
    summary = summary_values(run_file)
    assert summary["fp8/safe_and_eligible_layers"] == 1 and summary["fp8/layers"] == 4


def test_fp8_training_on_the_safe_layers_matches_full_precision_and_on_all_layers_it_does_not(probed, tmp_path):
    _, out = probed
    trained = job("train", "--results", str(out / "result.json"), "--steps", "600", "--out", str(tmp_path))
    assert trained["none"]["swapped"] == [] and trained["safe"]["swapped"] == list(ORDINARY)
    assert trained["all"]["swapped"] == ["planted", *ORDINARY]
    full, safe, every = (trained[k]["held_out_loss"] for k in ("none", "safe", "all"))
    assert abs(safe - full) <= 0.01 * full, (full, safe)  # measured 0.9983 of full precision
    assert every >= 1.10 * full, (full, every)  # measured 1.175: the planted layer's crushed features cost accuracy


def test_bad_arguments_are_refused_naming_them():
    for kwargs, match in [
        ({"sqnr_threshold_db": -1}, r"sqnr_threshold_db=-1"), ({"sqnr_threshold_db": math.inf}, r"sqnr_threshold_db=inf"),
        ({"sqnr_threshold_db": 150}, r"sqnr_threshold_db=150"), ({"confidence": 1.0}, r"confidence=1.0"),
        ({"confidence": 0}, r"confidence=0"), ({"confidence": math.nan}, r"confidence=nan"),
        ({"max_overhead": 0}, r"max_overhead=0"), ({"every_n_steps": 0}, r"every_n_steps=0"),
        ({"recipe": "blockwise"}, r"recipe='blockwise'"), ({"include": []}, r"include=\[\]"),
        ({"max_rows": 4}, r"max_rows=4"),
    ]:
        with pytest.raises(ValueError, match=match):
            FP8Probe(**kwargs)


def test_an_include_pattern_matching_no_layer_fails_before_the_first_step_listing_the_layers(tmp_path):
    from examples.fp8_outliers import OutlierData, OutlierMLP

    model = OutlierMLP()
    trainer = Trainer(accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      callbacks=[FP8Probe(include=["planted", "decoder.*"])], default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"include=\[\.\.\., 'decoder\.\*', \.\.\.\].*'planted', 'mid', 'wide', 'head'"):
        trainer.fit(model, datamodule=OutlierData())
    assert model.losses == []  # not one step ran
    trainer = Trainer(accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      callbacks=[FP8Probe(include=["planted"], exclude=["plant*"])], default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="selects no layer to probe"):
        trainer.fit(model, datamodule=OutlierData())


def test_the_fp8_gemm_is_torchaos_cast_and_the_emulation_agrees_with_scaled_mm():
    torch.manual_seed(0)
    a, b = torch.randn(64, 48), torch.randn(48, 32)
    for name in ("tensorwise", "rowwise"):
        recipe = Recipe.from_torchao(name)
        left, right = recipe.operands[Gemm.OUTPUT]
        ca, cb = cast(a, left, reduction_dim=-1), cast(b, right, reduction_dim=0)
        assert ca.data.dtype == torch.float8_e4m3fn and ca.scale.shape == ((64, 1) if name == "rowwise" else ())
        emulated = ca.dequantized() @ cb.dequantized()
        assert torch.allclose(fp8_mm(a, b, recipe, Gemm.OUTPUT), emulated, rtol=1e-5, atol=1e-5)
        assert 20 < sqnr_db(a @ b, emulated) < 40  # e4m3 x e4m3 on Gaussian data
    assert Recipe.from_torchao("tensorwise").operands[Gemm.GRAD_INPUT][0].dtype == torch.float8_e5m2  # gradients


def test_the_verdict_follows_the_confidence_bound():
    stats = RunningStats()
    for value in (24.0, 26.0):
        stats.add(value)
    stats.add(math.inf)  # an exact GEMM says nothing about the noise
    assert stats.count == 2 and stats.mean == 25.0
    low, high = stats.bounds(0.95)
    assert (low, high) == pytest.approx((25 - 12.706, 25 + 12.706), abs=1e-3)  # t(0.975, 1) x s / sqrt(n) = 12.706 x 1
    assert stats.verdict(20.0, 0.95) == "undecided" and stats.verdict(20.0, 0.5) == "safe"
    for value in (25.0, 24.5, 25.5):
        stats.add(value)
    assert stats.verdict(20.0, 0.95) == "safe" and stats.verdict(30.0, 0.95) == "unsafe"


def test_a_restored_probe_carries_its_samples_on(tmp_path):
    from examples.fp8_outliers import OutlierData, OutlierMLP

    def fit(probe: FP8Probe) -> None:
        Trainer(accelerator="cpu", max_steps=40, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, callbacks=[probe], default_root_dir=tmp_path).fit(OutlierMLP(), OutlierData())

    first = FP8Probe(every_n_steps=10, max_overhead=0.9, include=["planted"])
    fit(first)
    assert first.results["planted"]["samples"] >= 2
    second = FP8Probe(every_n_steps=10, max_overhead=0.9, include=["planted"])
    second.load_state_dict(first.state_dict())  # what Lightning does on resume (every rank; rank 0's sums count)
    fit(second)
    # The restored sums decided the layer already: the second fit takes no sample and keeps the verdict and statistics.
    assert second.samples_taken == first.samples_taken and second.sampled_steps == []
    assert second.results["planted"] == first.results["planted"]
