"""`lightning-ett tune` on a LightningCLI script whose throughput depends on its knobs in a known way (real trials)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import yaml
from conftest import SCRIPTS, run_script

from lightning_ett.tune.space import Space, SpaceError, cli_arguments, config_fragment, key

SCRIPT = str(SCRIPTS / "tune_job.py")
# 48 configurations, with an interaction (fused x width) and noise: BUDGET trials leave the rest untried for the
# proxy to rank (the batch size multiplies throughput); the best two of them then run twice more each.
SPACE = {"model.extra_layers": [0, 1, 2, 3], "model.width": [16, 32, 64], "model.fused": [True, False],
         "data.batch_size": [16, 32]}
BUDGET = 10
CONFIRMATION = 2 * 2
PROXY = ("--sampler", "proxy", "--seed", "5")  # seed 5: the 4-trial initial design holds an invalid combination


def invalid(config: dict) -> bool:  # tune_job.py refuses it
    return config["model.extra_layers"] == 0 and config["model.width"] == 64


def step_ms(config: dict) -> float:  # tune_job.py's known cost, whatever the batch size
    import sys

    sys.path.insert(0, str(SCRIPTS))
    from tune_job import step_ms as cost

    return cost(config["model.extra_layers"], config["model.width"], config["model.fused"])


def tune(out: Path, space: Path, *args: str) -> tuple[int, str]:
    proc = run_script("-m", "lightning_ett.launch.cli", "tune", SCRIPT, "--space", str(space), "--steps", "20", "--out",
                      str(out), *args, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict]:
    """A tune interrupted after 4 trials (budget 4, no confirmation), then continued to BUDGET with the same --out."""
    root = tmp_path_factory.mktemp("tune")
    space = root / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    out = root / "out"
    code, said = tune(out, space, "--budget", "4", "--confirm-top", "0", *PROXY)
    assert code == 0, said[-3000:]
    first = json.loads((out / "trials.json").read_text())["trials"]
    logs = {t["index"]: os.stat(Path(t["run_dir"]) / "trial.log").st_mtime_ns for t in first}
    code, said = tune(out, space, "--budget", str(BUDGET), *PROXY)
    assert code == 0, said[-3000:]
    return out, said, {"first": first, "logs": logs}


def test_the_default_sampler_is_optunas_tpe_through_the_same_real_trials_and_confirmation(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    out = tmp_path / "out"
    code, said = tune(out, space, "--budget", "6", "--confirm-top", "1")
    assert code == 0, said[-3000:]
    assert "sampler tpe, 4 random start-up trials" in said
    trials = json.loads((out / "trials.json").read_text())
    assert trials["sampler"] == "tpe" and len(trials["trials"]) == 6 + 2
    searched = [t for t in trials["trials"] if t["repeat"] == 0]
    assert len({key(t["config"]) for t in searched}) == 6  # six distinct configurations, each run once
    confirmed = [t for t in trials["trials"] if t["repeat"] > 0]
    assert len({key(t["config"]) for t in confirmed}) == 1 and [t["repeat"] for t in confirmed] == [1, 2]
    best = yaml.safe_load((out / "best.yaml").read_text())
    chosen = {f"model.{k}": v for k, v in best["model"].items()} | {"data.batch_size": best["data"]["batch_size"]}
    assert key(chosen) == key(confirmed[0]["config"])  # the confirmed one is the answer
    # continuing it with another sampler is refused (its history would mean something else)
    code, said = tune(out, space, "--budget", "8", "--sampler", "random")
    assert code == 2 and "holds a tune with another sampler" in said, said[-2000:]


def test_tune_finds_the_known_best_confirms_it_and_writes_a_best_yaml_that_runs(tuned, tmp_path):
    out, said, _ = tuned
    trials = json.loads((out / "trials.json").read_text())["trials"]
    ok = [t for t in trials if t["outcome"] == "ok"]
    confirmed = [t for t in trials if t["repeat"] > 0]
    assert len(confirmed) == CONFIRMATION and len({key(t["config"]) for t in confirmed}) == 2
    first_runs = sorted((t for t in ok if t["repeat"] == 0), key=lambda t: -t["objective"])
    assert {key(t["config"]) for t in confirmed} == {key(t["config"]) for t in first_runs[:2]}  # the two best, again
    runs = {k: sorted(t["objective"] for t in ok if key(t["config"]) == k) for k in {key(t["config"]) for t in confirmed}}
    winner = max(runs, key=lambda k: runs[k][1])  # the higher median of three runs
    text = (out / "best.yaml").read_text()
    chosen = json.loads(winner)
    assert yaml.safe_load(text) == config_fragment(chosen)
    assert text.startswith(f"# lightning-ett tune: best median throughput {runs[winner][1]:.6g}, 3 runs: min")  # spread
    # the search found one of the fastest: within the 6 best of the 42 valid configurations, by the known cost
    valid = sorted((c for c in Space.from_mapping(SPACE).configurations() if not invalid(c)),
                   key=lambda c: -c["data.batch_size"] / step_ms(c))
    assert key(chosen) in {key(c) for c in valid[:6]}, (chosen, valid[:6])
    assert (out / "tune_report.png").read_bytes()[:4] == b"\x89PNG"
    assert "Top configurations by median measured throughput" in said and "leave-one-out Spearman" in said
    assert "confirmation run 2" in said and "best: " in said and "(runs " in said  # progress, then the result
    for t in ok:  # measured from each trial's own ETT ledger, under lightning run
        m = t["measurements"]
        assert m["throughput"] > 0 and m["startup_s"] > 0 and Path(t["run_dir"], "run", "ledger").is_dir()
        # A step sleeps at least 0.9x its known cost, so the median step cannot be shorter; the upper bound is loose on
        # purpose (a loaded 2-core CI machine added 15 ms a step once): it catches start-up or another phase counted
        # as a step (4 s over 20 steps is 200 ms a step), not the machine's load.
        assert 0.9 * step_ms(t["config"]) <= m["step_s"] * 1000 < 2 * step_ms(t["config"]) + 60
    # best.yaml is a LightningCLI config fragment: it loads with --config (with the values it names) and runs.
    proc = run_script(SCRIPT, "fit", "--config", str(out / "best.yaml"), "--print_config", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = yaml.safe_load(proc.stdout)
    assert printed["model"] == config_fragment(chosen)["model"] and printed["data"] == config_fragment(chosen)["data"]
    proc = run_script(SCRIPT, "fit", "--config", str(out / "best.yaml"), "--trainer.max_steps", "3", cwd=tmp_path)
    assert proc.returncode == 0 and "`max_steps=3` reached" in proc.stderr, proc.stderr[-2000:]


def test_a_failing_trial_is_recorded_with_its_reason_and_the_search_goes_on(tuned):
    out, _, _ = tuned
    trials = json.loads((out / "trials.json").read_text())["trials"]
    failed = [t for t in trials if t["outcome"] == "failed"]
    assert failed and all(invalid(t["config"]) for t in failed) and failed[0]["round"] == 0  # in the initial design
    assert all("width=64 needs extra_layers >= 1" in t["reason"] and t["objective"] is None for t in failed)
    assert len(trials) == BUDGET + CONFIRMATION and failed[0]["index"] < max(t["index"] for t in trials)  # went on


def test_a_resumed_tune_skips_the_trials_it_has_and_runs_only_the_rest(tuned):
    out, said, state = tuned
    trials = json.loads((out / "trials.json").read_text())["trials"]
    assert trials[:4] == state["first"]  # the first four, unchanged
    for index, mtime in state["logs"].items():  # and not run again
        assert os.stat(Path(trials[index]["run_dir"]) / "trial.log").st_mtime_ns == mtime
    assert "(4 done already)" in said
    assert len({key(t["config"]) for t in trials}) == BUDGET and all(t["round"] >= 1 for t in trials[4:])
    assert [t["repeat"] for t in trials[:BUDGET]] == [0] * BUDGET  # each configuration once, then the confirmation


def test_the_report_has_the_proxys_prediction_for_every_configuration(tuned):
    """predictions.json: left out for each configuration that ran, fitted on all for every other valid one. (How well
    the proxy ranks an interaction is tested without scripts, in tests/test_tune_search.py.)"""
    out, _, _ = tuned
    predictions = json.loads((out / "predictions.json").read_text())
    trials = json.loads((out / "trials.json").read_text())["trials"]
    ran_ok = {key(t["config"]) for t in trials if t["outcome"] == "ok"}
    assert set(predictions["tried_left_out"]) == ran_ok
    assert len(predictions["untried"]) == Space.from_mapping(SPACE).size - len({key(t["config"]) for t in trials})
    assert all(v > 0 for v in [*predictions["untried"].values(), *predictions["tried_left_out"].values()])


@pytest.mark.parametrize(("space", "args", "message"), [
    ({"model.extra_layer": [0, 1]}, ["--budget", "4"], "'model.extra_layer' is not an option.*Did you mean 'model.extra_layers'"),
    ({"model.width": []}, ["--budget", "4"], "'model.width' has an empty list"),
    ({"model.width": [16, 32, 64]}, ["--budget", "2"], r"--budget 2 is smaller than the initial design \(3 trials"),
    ({"model.width": [16, 32]}, ["--budget", "3", "--objective", "ett"], "--objective ett needs --job-hours"),
    ({"model.width": [16, 32]}, ["--budget", "3", "--objective", "ett", "--job-hours", "5"],
     r"--objective ett needs --mtbf-hours \(or --mtbf-from\) > 0"),
    ({"model.width": [16, 32]}, ["--budget", "3", "--objective", "ett", "--job-hours", "5", "--mtbf-from", "/nonexistent"],
     "--mtbf-from '/nonexistent': no ETT ledger"),
    ({"model.width": [16, 32]}, ["--budget", "3", "--objective", "ett", "--job-hours", "5", "--mtbf-hours", "2"],
     "--objective ett needs the script to checkpoint with lightning_ett.AsyncCheckpoint"),
    ({"model.width": [16, 32]}, ["--budget", "3", "--confirm-runs", "-1"], "--confirm-runs -1: expected an integer >= 0"),
    ({"model.width": [16, 32], "trainer.max_steps": [10, 20]}, ["--budget", "3"],
     "'trainer.max_steps' is set by every trial from --steps"),
    ({"model": {"width": [16, 32]}}, ["--budget", "3"], r"write nested options dotted.*`model.width: \[...\]`"),
])
def test_bad_input_fails_before_any_trial(tmp_path, space, args, message):
    import re

    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    code, said = tune(tmp_path / "out", path, *args)
    assert code == 2 and re.search(message, said), said[-2000:]
    assert not list((tmp_path / "out").glob("trial-*"))  # no trial ran


def test_an_unwritable_out_fails_before_any_trial(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"model.width": [16, 32]}))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, said = tune(blocker / "out", path, "--budget", "2")
    assert code == 2 and "--out=" in said and "is not writable" in said, said[-2000:]


def test_space_parsing_features_and_fragments():
    space = Space.from_mapping({"data.batch_size": [128, 256, 1024], "model.compile_dense": [True, False],
                                "trainer.strategy.init_args.sharding_type": ["table_wise", "row_wise"]})
    assert space.size == 12 and space.min_budget == 3 and space.initial_size(12) == 5 and space.initial_size(6) == 3
    config = {"data.batch_size": 256, "model.compile_dense": True, "trainer.strategy.init_args.sharding_type": "row_wise"}
    assert space.features(config) == [8.0, 1.0, 0.0, 1.0]  # log2, bool, one-hot
    assert cli_arguments(config) == ["--data.batch_size", "256", "--model.compile_dense", "true",
                                     "--trainer.strategy.init_args.sharding_type", "row_wise"]
    assert config_fragment(config) == {"data": {"batch_size": 256}, "model": {"compile_dense": True},
                                       "trainer": {"strategy": {"init_args": {"sharding_type": "row_wise"}}}}

    design = space.initial_design(random.Random(0), 5)
    for option, values in space.options.items():  # every value of every option at least once
        assert {c[option] for c in design} >= set(values) or len(values) > len(design)
    with pytest.raises(SpaceError, match="lists a value twice"):
        Space.from_mapping({"data.batch_size": [1, 1]})
    with pytest.raises(SpaceError, match="not `--data.batch_size`"):
        Space.from_mapping({"--data.batch_size": [1, 2]})


def test_a_value_whose_only_trial_failed_is_explored_next_round(tmp_path):
    """The search itself (no script): a failed trial in the initial design leaves its values unseen by the proxy;
    the next round's exploration runs the most promising configuration that has them, not a random one."""
    from lightning_ett.tune.samplers import ProxySampler
    from lightning_ett.tune.search import search
    from lightning_ett.tune.trials import TrialLog

    space = Space.from_mapping({"a": [0, 1, 2, 3], "b": ["x", "y", "z"], "c": [True, False]})
    budget = 4 + 3
    first = space.initial_design(random.Random(0), space.initial_size(budget))[0]

    def evaluate(index, config):  # the first configuration of the initial design fails
        if config == first:
            return "refused", {}, 0.0, None
        return None, {"throughput": 100.0 / (1 + config["a"])}, 0.0, None  # known effect of a

    log = TrialLog(tmp_path)
    search(space, evaluate, lambda m: m.get("throughput"), log, budget, ProxySampler(space, budget, seed=0))
    initial = [t for t in log.trials if t.round == 0]
    assert initial[0].outcome == "failed" and first["a"] not in {t.config["a"] for t in initial[1:]}
    assert any(t.round == 1 and t.outcome == "ok" and t.config["a"] == first["a"] for t in log.trials)  # filled in round 1
