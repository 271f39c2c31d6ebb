"""FP8Probe on a model with a planted FP8-sensitive layer: verdicts, budget, emulated FP8 training, outputs, bad input."""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SCRIPTS, run_script
from helpers.fp8_agreement import against_torchao
from helpers.wandb_records import find_run_file, history_rows, summary_values
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from lightning_ett import FP8Probe, summarize_run_dir
from lightning_ett.fp8.cast import Gemm, Recipe, cast, fp8_mm, matmul, sqnr_db
from lightning_ett.fp8.probe import LayerRecord, sample_forward

JOB = str(SCRIPTS / "fp8_job.py")
ORDINARY = ("mid", "wide", "head")
BUDGET = 0.2  # the probed fixture's max_overhead


def job(*args: str, timeout: float = 300) -> dict:
    out = Path(args[args.index("--out") + 1])
    proc = run_script(JOB, *args, timeout=timeout, cwd=out)  # a Trainer's default_root_dir is its cwd: not the repo
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """The planted model trained 2000 steps under bf16-mixed with FP8Probe(max_overhead=0.2), ETTMonitor and a
    WandbLogger (offline).

    At the default 2 % budget a sample here (4 layers, bf16 on 2 CPU cores: ~25 ms, 5 training steps) buys a window
    every ~250 steps, too few in 2000 steps for the 36 a verdict needs; the default budget's own test is below.
    """
    out = tmp_path_factory.mktemp("fp8-probe")
    return job("probe", "--out", str(out), "--steps", "2000", "--run-dir", str(out / "run"), "--wandb-dir", str(out),
               "--precision", "bf16-mixed", "--probe-args", json.dumps({"max_overhead": BUDGET}), timeout=600), out


def test_under_bf16_mixed_the_planted_layer_is_unsafe_and_every_layer_decided_or_told_why(probed):
    result, _ = probed
    layers = result["results"]
    assert sorted(layers) == sorted(("planted", *ORDINARY))
    planted = layers["planted"]
    assert planted["verdict"] == "unsafe" and planted["bad_windows"] >= 2, planted
    assert planted["flushed_share"]["input"] > 0.1 and planted["amax"]["input"] > 5e4  # the outliers, in the real input
    # Its input is data (no gradient): the grad-input GEMM never runs, and is not measured.
    assert planted["measured_gemms"] == ["output", "grad_weight"]
    for fqn in ORDINARY:
        assert layers[fqn]["measured_gemms"] == ["output", "grad_input", "grad_weight"]
        assert layers[fqn]["verdict"] != "unsafe" or layers[fqn]["bad_windows"] >= 2, (fqn, layers[fqn])
        # on CPU the FP8 GEMM is the emulation (torch's CPU _scaled_mm computes the same numbers at ~10x the cost)
        assert {g["kernel"] for g in layers[fqn]["gemms"].values()} == {"emulated"}
    assert any(r["verdict"] == "safe" for r in layers.values())
    # On the trained model's own tensors, each GEMM's predicted SQNR is torchao's Float8Linear's (0.5 dB)
    for fqn, gemms in result["agreement"].items():
        for gemm, (predicted, measured) in gemms.items():
            assert abs(predicted - measured) <= 0.5, (fqn, gemm, predicted, measured)
    for r in layers.values():
        assert r["reason"] and (r["verdict"] != "undecided" or "more steps" in r["reason"]), r
        assert set(r["sqnr_db_worst_per_gemm"]) == set(r["measured_gemms"])
    # Eligibility is torchao's: 64 -> 1040 passes its tensorwise rules, 1040 -> 64 and 1040 -> 1 do not.
    assert [f for f, r in layers.items() if r["eligible"]] == ["planted", "wide"]
    assert abs(sum(r["flop_share"] for r in layers.values()) - 1) < 1e-9
    assert result["summary_line"].startswith("FP8-safe and eligible: ")
    assert "planted" not in result["selected"]  # torchao converts what the filter selects
    assert result["converted"] == result["selected"]


def test_the_probe_stays_within_its_overhead_budget(probed):
    result, _ = probed
    assert 0 < result["overhead"] <= BUDGET * 1.5, result["overhead"]  # its own timers: hooks, GEMMs and verdicts
    # The same cost from the training loop's own step clock: the sampled steps' extra time over a typical step.
    # (A whole loop with / without the probe moves by +-15 % between identical runs on this 2-core VM; that
    # comparison, over alternating rounds with an A/A control, is benchmarks/fp8_probe.py's.)
    steps, sampled = result["step_s_with"], set(result["sampled_steps"])
    assert len(sampled) == result["samples_taken"] >= 10
    typical = statistics.median(s for i, s in enumerate(steps) if i not in sampled)
    extra = sum(steps[i] - typical for i in sampled)
    assert extra / sum(steps) <= BUDGET * 1.5, extra / sum(steps)


def test_the_results_go_to_the_run_dir_the_report_and_wandb(probed):
    result, out = probed
    written = json.loads((out / "run" / "fp8_probe.json").read_text())
    assert written["layers"] == result["results"] and written["summary"] == result["summary_line"]
    verdicts = [r["verdict"] for r in result["results"].values()]
    (fact,) = summarize_run_dir(out / "run").facts_named("fp8_probe")
    assert (fact["layers"], fact["unsafe"], fact["undecided"]) == (4, verdicts.count("unsafe"), verdicts.count("undecided"))
    run_file = find_run_file(out)
    rows = history_rows(run_file)
    assert any(row.get("fp8/probe/_type") == "table-file" and row.get("fp8/probe/nrows") == 4 for row in rows)
    # the verdict counts, as a series over training (a layer turning unsafe shows there)
    series = [row["fp8/unsafe_layers"] for row in rows if "fp8/unsafe_layers" in row]
    assert len(series) >= 5 and series[-1] == verdicts.count("unsafe")
    summary = summary_values(run_file)
    assert summary["fp8/layers"] == 4 and summary["fp8/unsafe_layers"] == verdicts.count("unsafe")
    assert summary["fp8/turned_unsafe_layers"] == sum(r["turned_unsafe"] for r in result["results"].values())


@pytest.mark.timeout(900)  # the probed fixture (~100 s) and three 600-step trainings (~200 s) count: 300 s was the edge
def test_torchao_fp8_training_on_the_safe_layers_keeps_the_bf16_loss_and_on_all_layers_it_does_not(probed, tmp_path):
    """torchao's own Float8Linear (convert_to_float8_training runs on this CPU: torch 2.13 has _scaled_mm here)."""
    gemm_s = _scaled_mm_seconds()
    if gemm_s > 0.005:  # 37-39 ms on a VM of 2026-12-05, where its 3 trainings took > 600 s (they fit 300 s before)
        pytest.skip(f"this CPU's torch._scaled_mm takes {1000 * gemm_s:.1f} ms for a 256x64x128 GEMM: the three "
                    "600-step FP8 trainings would not fit the suite's time")
    _, out = probed
    trained = job("train", "--results", str(out / "result.json"), "--steps", "600", "--out", str(tmp_path),
                  "--precision", "bf16-mixed", timeout=600)
    safe = [f for f, r in json.loads((out / "result.json").read_text())["results"].items() if r["verdict"] == "safe"]
    assert trained["none"]["swapped"] == [] and trained["safe"]["swapped"] == safe and trained["safe"]["fp8"] == "torchao"
    assert trained["all"]["swapped"] == ["planted", *ORDINARY]
    full, safe_loss, every = (trained[k]["held_out_loss"] for k in ("none", "safe", "all"))
    assert abs(safe_loss - full) <= 0.02 * full, (full, safe_loss)  # the stated tolerance: 2 % of the bf16 loss
    assert every >= 1.10 * full, (full, every)  # the planted layer's crushed features cost accuracy


def _scaled_mm_seconds() -> float:
    """One warm FP8 GEMM of a size the trainings run, on this CPU."""
    import time

    a = torch.randn(256, 64).to(torch.float8_e4m3fn)
    b = torch.randn(128, 64).to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0)
    torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    start = time.perf_counter()
    for _ in range(5):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return (time.perf_counter() - start) / 5


def test_bad_arguments_are_refused_naming_them():
    for kwargs, match in [
        ({"sqnr_threshold_db": -1}, r"sqnr_threshold_db=-1"), ({"sqnr_threshold_db": math.inf}, r"sqnr_threshold_db=inf"),
        ({"sqnr_threshold_db": 150}, r"sqnr_threshold_db=150"), ({"confidence": 1.0}, r"confidence=1.0"),
        ({"confidence": 0}, r"confidence=0"), ({"confidence": math.nan}, r"confidence=nan"),
        ({"max_overhead": 0}, r"max_overhead=0"), ({"every_n_steps": 0}, r"every_n_steps=0"),
        ({"recipe": "blockwise"}, r"recipe='blockwise'"), ({"include": []}, r"include=\[\]"),
        ({"max_rows": 4}, r"max_rows=4"), ({"tail": 0}, r"tail=0"), ({"tail": 1.5}, r"tail=1.5"),
        ({"recheck_every": 0}, r"recheck_every=0"),
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


def test_the_fp8_gemm_is_torchaos_cast_and_the_emulation_is_torchs_cpu_scaled_mm():
    torch.manual_seed(0)
    a, b = torch.randn(64, 48), torch.randn(48, 32)
    for name in ("tensorwise", "rowwise"):
        recipe = Recipe.from_torchao(name)
        left, right = recipe.operands[Gemm.OUTPUT]
        ca, cb = cast(a, left, reduction_dim=-1), cast(b, right, reduction_dim=0)
        assert ca.data.dtype == torch.float8_e4m3fn and ca.scale.shape == ((64, 1) if name == "rowwise" else ())
        scaled_mm = torch._scaled_mm(ca.data, cb.data.t().contiguous().t(), scale_a=ca.scale.reciprocal(),
                                     scale_b=cb.scale.reciprocal(), out_dtype=torch.float32)
        emulated, kernel = matmul(ca, cb)
        assert kernel == "emulated" and torch.allclose(emulated, scaled_mm, rtol=1e-5, atol=1e-5)
        assert torch.allclose(fp8_mm(a, b, recipe, Gemm.OUTPUT), emulated)
        assert 20 < sqnr_db(a @ b, emulated) < 40  # e4m3 x e4m3 on Gaussian data
        assert recipe.fast_accum == {Gemm.OUTPUT: True, Gemm.GRAD_INPUT: False, Gemm.GRAD_WEIGHT: False}  # torchao's
    assert Recipe.from_torchao("tensorwise").operands[Gemm.GRAD_INPUT][0].dtype == torch.float8_e5m2  # gradients


PRECISIONS = {"32-true": (torch.float32, None), "bf16-mixed": (torch.float32, torch.bfloat16),
              "16-mixed": (torch.float32, torch.float16), "bf16-true": (torch.bfloat16, None)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_the_probes_sqnr_is_torchaos_float8linear_sqnr_under_each_precision(precision, recipe):
    """Each GEMM's predicted SQNR against the SQNR of torchao's real Float8Linear output and gradients, on the same
    tensors, under the precision (autocast's dtype, or the parameters'). Tolerance: 0.5 dB. (torchao is given its
    input in autocast's dtype, as it casts it on a GPU: helpers/fp8_agreement.py.)"""
    param_dtype, autocast = PRECISIONS[precision]
    torch.manual_seed(0)
    layer = nn.Linear(256, 128, bias=False).to(param_dtype)
    x = torch.randn(512, 256, dtype=param_dtype)
    x[:, :4] *= 50  # a few larger channels, as real activations have
    found = against_torchao(layer, x, torch.randn(512, 128) * 1e-3, recipe, autocast)
    assert found.compute_dtype == (autocast or param_dtype)
    assert found.output_dtypes == {"reference": autocast or param_dtype, "torchao": autocast or param_dtype}
    for gemm, value in found.measured.items():
        assert abs(found.predicted[gemm] - value) <= 0.5, (gemm, found.predicted, found.measured)


def test_a_sample_keeps_max_rows_of_the_activation_not_the_activation():
    r = Recipe.from_torchao("rowwise")
    x, weight = torch.randn(8192, 64), torch.randn(32, 64)
    sample = sample_forward(x, weight, torch.bfloat16, r, 128, torch.Generator())
    assert sample.x.shape == (128, 64) and sample.x.dtype == torch.bfloat16 and sample.rows.shape == (128,)
    assert sample.x_amax is None and sample.x_amax_grad_weight.shape == (1, 64)  # per column, over all 8192 rows
    kept = [t for t in (sample.x, sample.x_amax_grad_weight, sample.weight, sample.rows) if t is not None]
    assert sum(t.numel() for t in kept) < 128 * 64 + 64 + 32 * 64 + 128 + 1
    # the per-column scale still sees a row the sample did not keep
    x[sample.rows.max() + 1 if sample.rows.max() + 1 < 8192 else 0, 5] = 1e4
    again = sample_forward(x, weight, torch.bfloat16, r, 128, torch.Generator())
    assert float(again.x_amax_grad_weight[0, 5]) == pytest.approx(1e4, rel=1e-2)


def test_a_restored_probe_carries_its_samples_on_and_a_second_fit_starts_over(tmp_path):
    from examples.fp8_outliers import OutlierData, OutlierMLP

    def trainer(probe: FP8Probe, steps: int) -> Trainer:
        return Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, callbacks=[probe], default_root_dir=tmp_path)

    first = FP8Probe(every_n_steps=10, max_overhead=0.9, include=["planted"])
    t = trainer(first, 40)
    t.fit(OutlierMLP(), OutlierData())
    assert first.results["planted"]["samples"] >= 2
    t.save_checkpoint(tmp_path / "step40.ckpt")
    second = FP8Probe(every_n_steps=10, max_overhead=0.9, include=["planted"])
    trainer(second, 80).fit(OutlierMLP(), OutlierData(), ckpt_path=tmp_path / "step40.ckpt")
    # The restored sums decided the layer already: the second fit takes no sample and keeps the verdict and statistics.
    assert second.samples_taken == first.samples_taken and second.sampled_steps == []
    assert second.results["planted"] == first.results["planted"]
    # The same callback in a new fit, not resumed: it measures that fit, not the last one's leftovers.
    trainer(first, 40).fit(OutlierMLP(), OutlierData())
    assert first.samples_taken == len(first.sampled_steps) >= 2 and first.sampled_steps[0] >= 10


class _TurningBad(torch.utils.data.IterableDataset):
    """The planted model's data with ordinary inputs until ``at``, then the huge outlier features."""

    def __init__(self, at: int) -> None:
        from examples.fp8_outliers import OutlierBatches

        self.at, self.calm, self.wild = at, OutlierBatches(256, 1.0, 0, 0), OutlierBatches(256, 1e5, 0, 0)

    def __iter__(self):  # type: ignore[no-untyped-def]
        index = 0
        while True:
            yield (self.calm if index < self.at else self.wild).batch(index)
            index += 1


def test_a_safe_layer_that_turns_bad_later_is_said_unsafe_at_once_and_in_the_results(tmp_path):
    from examples.fp8_outliers import OutlierMLP

    probe = FP8Probe(every_n_steps=1, max_overhead=0.9, include=["planted"], recheck_every=2)
    trainer = Trainer(accelerator="cpu", max_steps=400, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[probe], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"planted, safe until now, is unsafe: its re-checks found"):
        trainer.fit(OutlierMLP(), torch.utils.data.DataLoader(_TurningBad(at=300), batch_size=None))
    planted = probe.results["planted"]
    assert planted["verdict"] == "unsafe" and planted["turned_unsafe"], planted
    assert planted["safe_at_window"] < 300 <= planted["unsafe_at_window"]  # safe on calm data, unsafe on wild
    assert "after being safe from step" in planted["reason"] and "turned unsafe after being safe: planted" in \
        probe.summary_line()
    assert probe.turned_unsafe and probe.turned_unsafe[0]["layer"] == "planted"
    assert json.loads((tmp_path / "fp8_probe.json").read_text())["layers"]["planted"]["turned_unsafe"] is True


def test_at_the_default_budget_an_undecided_layer_says_how_many_more_steps_would_decide_it(tmp_path):
    from examples.fp8_outliers import OutlierData, OutlierMLP

    probe = FP8Probe()
    Trainer(accelerator="cpu", max_steps=300, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[probe], default_root_dir=tmp_path).fit(OutlierMLP(), OutlierData())
    undecided = {f: r for f, r in probe.results.items() if r["verdict"] == "undecided"}
    assert undecided
    for r in undecided.values():
        assert r["samples"] < r["samples_needed"]
        assert re.search(r"a window every ~\d+ steps \(the 2% budget, and the steps the layer ran in\); ~\d+ more "
                         r"steps, or a larger max_overhead", r["reason"]), r["reason"]
    assert f"{len(undecided)} undecided (why: fp8_probe.json)" in probe.summary_line()


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_a_users_frozen_and_configure_model_layers_are_probed_under_every_precision(precision, tmp_path):
    """A frozen projection of raw features (its backward hook never fires) and layers built in configure_model
    (after the callbacks' setup), on one device: every layer measured, each on the GEMMs it really runs."""
    sys.path.insert(0, str(SCRIPTS))
    from fp8_job import UserModel

    probe = FP8Probe(every_n_steps=5, max_overhead=0.9)
    Trainer(accelerator="cpu", max_steps=60, precision=precision, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[probe], default_root_dir=tmp_path
            ).fit(UserModel())
    results = probe.results
    assert sorted(results) == ["body.0", "body.2", "body.4", "proj"]
    assert results["proj"]["measured_gemms"] == ["output"]  # frozen, fed data: only its forward GEMM runs
    assert results["body.0"]["measured_gemms"] == ["output", "grad_weight"]  # its input (proj's output) needs no grad
    assert results["body.2"]["measured_gemms"] == results["body.4"]["measured_gemms"] == ["output", "grad_input",
                                                                                          "grad_weight"]
    for fqn, r in results.items():
        # (an unsafe layer is not sampled again: sampling stops at the verdict)
        assert (r["samples"] >= 5 or r["verdict"] == "unsafe") and r["sqnr_db_worst"] is not None and r["reason"], (fqn, r)


class _Awkward(LightningModule):
    """What real models do to a probe: repeated block names, a keyword call, a shared layer, an empty expert."""

    def __init__(self, compiled: bool = False) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.dec = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.shared = nn.Linear(16, 16)
        self.expert = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.compiled = compiled

    def configure_model(self) -> None:
        if self.compiled:
            for name in ("enc", "dec", "shared", "expert", "head"):
                setattr(self, name, torch.compile(getattr(self, name), backend="eager"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.shared(self.dec(self.enc(x))))
        routed = h[h[:, 0] > 1e9]  # no row ever qualifies: the expert runs on 0 rows
        h = h + self.expert(routed).sum() * 0
        return self.head(input=h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch).pow(2).mean()

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(64 * 16, 16), batch_size=64)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _fit_awkward(tmp_path: Path, compiled: bool = False) -> FP8Probe:
    probe = FP8Probe(every_n_steps=1, max_overhead=0.9)
    Trainer(accelerator="cpu", max_steps=40, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[probe], default_root_dir=tmp_path).fit(_Awkward(compiled))
    return probe


def test_keyword_calls_empty_experts_shared_layers_and_repeated_names(tmp_path):
    probe = _fit_awkward(tmp_path)
    r = probe.results
    assert r["head"]["samples"] >= 2 and r["head"]["measured_gemms"] == ["output", "grad_input", "grad_weight"]
    assert r["expert"]["verdict"] == "undecided" and r["expert"]["measured_gemms"] == []  # never had a row
    # FLOPs per step: the shared layer (16 -> 16) runs twice a step, enc.2 (32 -> 16, twice its GEMM) once
    assert r["shared"]["flop_share"] == pytest.approx(r["enc.2"]["flop_share"], rel=1e-6)
    # A filter applied to a submodule: a tail shared by enc.2 and dec.2 matches neither; a prefix names it
    probe.results["enc.2"]["verdict"], probe.results["dec.2"]["verdict"] = "safe", "unsafe"
    for name in ("enc.2", "dec.2"):
        probe.results[name]["eligible"] = True
    tails = probe.module_filter_fn()
    assert not tails(nn.Linear(32, 16), "2")
    assert probe.module_filter_fn(prefix="enc")(nn.Linear(32, 16), "2")
    assert not probe.module_filter_fn(prefix="dec")(nn.Linear(32, 16), "2")
    assert tails(nn.Linear(32, 16), "enc.2") and not tails(nn.Linear(32, 16), "dec.2")


def test_a_compiled_module_that_runs_no_hook_is_said_once(tmp_path):
    with pytest.warns(UserWarning, match="ran none of the probed layers' forward hooks") as caught:
        probe = _fit_awkward(tmp_path, compiled=True)
    assert sum("ran none of the probed" in str(w.message) for w in caught) == 1
    assert all("torch.compile" in r["reason"] for r in probe.results.values())


class _Periodic(LightningModule):
    """A layer run on even steps only, beside one run every step; long and bracketed names (rich markup)."""

    def __init__(self) -> None:
        super().__init__()
        self.every = nn.Linear(16, 16)
        self.even_steps_only = nn.Linear(16, 16)
        self.heads = nn.ModuleDict({"lang[/en]": nn.Linear(16, 1)})
        self.encoder_layer_11_attention_output_dense_projection_for_the_long_names = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder_layer_11_attention_output_dense_projection_for_the_long_names(self.every(x))
        if self.global_step % 2 == 0:
            h = self.even_steps_only(h)
        return self.heads["lang[/en]"](h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch).pow(2).mean()

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(64 * 16, 16), batch_size=64)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_sampling_does_not_alias_with_periodic_work_and_the_table_keeps_every_name(tmp_path, capsys):
    probe = FP8Probe(every_n_steps=2, max_overhead=0.9)
    Trainer(accelerator="cpu", max_steps=120, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[probe], default_root_dir=tmp_path).fit(_Periodic())
    steps = probe.sampled_steps
    assert len({s // 2 for s in steps}) == len(steps)  # one sample a window at most ...
    gaps = {b - a for a, b in itertools.pairwise(steps)}
    assert len(gaps) > 1 and {s % 2 for s in steps} == {0, 1}  # ... at random distances: a fixed stride aliases
    r = probe.results
    assert r["even_steps_only"]["samples"] >= 3  # measured, though it skips every other step
    share = r["even_steps_only"]["flop_share"] / r["every"]["flop_share"]
    assert 0.2 < share < 0.8, share  # ~half the steps: not counted as if it ran in every one
    # Not a terminal (the case under `lightning run`): the table is as wide as its names; markup is not parsed
    printed = capsys.readouterr().out
    for name in ("lang[/en]", "encoder_layer_11_attention_output_dense_projection_for_the_long_names"):
        assert any(line.count(name) == 1 and "│" in line for line in printed.splitlines()), (name, printed)
    assert (tmp_path / "fp8_probe.json").is_file()


def test_a_model_without_linear_layers_trains_with_the_probe_off_and_a_warning(tmp_path):
    class NoLinear(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(16))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return (batch * self.w).pow(2).mean()

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(64, 16), batch_size=8)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    probe = FP8Probe(every_n_steps=1)
    with pytest.warns(UserWarning, match="NoLinear has no nn.Linear layer.*the probe is off"):
        Trainer(accelerator="cpu", max_steps=8, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, callbacks=[probe], default_root_dir=tmp_path).fit(NoLinear())
    assert probe.results == {} and probe.samples_taken == 0


def test_windows_from_a_checkpoint_with_another_every_n_steps_are_renumbered_by_their_first_step():
    record = LayerRecord("x", 4, 4, 20.0, windows={0: 30.0, 1: 25.0, 2: 10.0, 7: 28.0})
    record.renumber_windows(2, 5)  # steps 0, 2, 4, 14 -> windows 0, 0, 0, 2 of 5 steps
    assert record.windows == {0: 10.0, 2: 28.0}


def test_an_overflowed_window_is_bad_whatever_order_ranks_and_gemms_come_in():
    orders = []
    for values in ([30.0, math.nan], [math.nan, 30.0]):
        record = LayerRecord("x", 4, 4, 20.0)
        for v in values:
            record._observe(3, v)  # two GEMMs of one sample
        orders.append(record.decision(0.1, 0.95).bad_windows)
        ranks = [LayerRecord("x", 4, 4, 20.0, windows={3: v}).to_vector() for v in values]
        orders.append(LayerRecord.from_vectors("x", 4, 4, 20.0, ranks).decision(0.1, 0.95).bad_windows)
    assert orders == [1, 1, 1, 1]


def test_a_loaded_state_not_yet_applied_is_saved_again_as_it_came():
    """A resume that trains no step (the checkpoint is at max_steps) and saves again keeps the windows."""
    first = FP8Probe()
    state = {"records": {"a": [1.0, 2.0]}, "next_sample_step": 70, "samples_taken": 5, "every_n_steps": 10}
    first.load_state_dict(state)
    assert first.state_dict() == state
