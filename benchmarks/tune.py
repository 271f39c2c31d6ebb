"""`lightning-ett tune` vs Optuna's TPE vs random search, replayed on measured grids.

    .venv/bin/python benchmarks/tune.py [--seeds 10] [--grids dlrm user] [--proxy KIND]

Two grids of real trials, measured by ``benchmarks/tune_grid.py`` exactly as ``tune`` measures
its trials (``lightning run`` on 2 gloo ranks, the ETT ledger):

* ``dlrm``: the example DLRM's 48 configurations, one run each — the grid the search design
  (initial design size, rounds, the proxy model) was chosen on;
* ``user``: the held-out grid, the user job's 48 configurations, two runs each, measured after
  the design was fixed. Nothing was designed on it.

For each grid, objective and seed, every arm runs the same search loop
(:func:`lightning_ett.tune.search.search`) with the same budget (a quarter of the grid), then
the same confirmation (the 2 best medians re-run 2 more times each; the best median wins); only
the sampler differs:

* ``proxy``: our proxy sampler (``--sampler proxy``: a D-optimal initial design, then rounds
  ranked by a Gaussian process);
* ``tpe_defaults``: Optuna's TPE sampler with its defaults (``TPESampler(seed=seed)``: 10
  random start-up trials);
* ``tpe``: TPE as a user who read Optuna's docs would set it for a small budget —
  ``multivariate=True``, ``n_startup_trials`` = the proxy's initial design size — which is what
  ``lightning-ett tune`` runs by default since this benchmark (``--sampler tpe``);
* ``random``: uniform without replacement.

A trial is answered by one of the configuration's stored runs, drawn at random (so a replayed
trial is one noisy draw, as a real one is); the configuration's true value is the mean of its
runs. Scored: **regret** = 1 − true value of the configuration the arm chose ÷ the grid's best
true value, and whether it is within 5 % of it.

Goals (issue #35), on the held-out grid with 10 seeds: ``tune`` within 5 % in ≥ 8 of 10 seeds,
and its median regret lower than TPE's and random's; if the proxy does not beat TPE, TPE becomes
the default.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from tune_grid import GRIDS, runs_of

from lightning_ett.tune.measure import Measurement
from lightning_ett.tune.objective import score
from lightning_ett.tune.samplers import ProxySampler, TPESampler, make_sampler
from lightning_ett.tune.search import best, search
from lightning_ett.tune.space import Space, key
from lightning_ett.tune.trials import TrialLog

ARMS = ("proxy", "tpe_defaults", "tpe", "random")
JOB_HOURS, MTBF_HOURS = 24.0, 1.0  # the `ett` objective's job (stated in benchmarks/README.md)
CONFIRM_TOP, CONFIRM_RUNS = 2, 2


@dataclass(frozen=True)
class Replay:
    """A grid under one objective: every configuration's per-run values (None: that run failed)."""

    space: Space
    runs: dict[str, list[float | None]]
    configs: dict[str, dict[str, Any]]

    @property
    def truth(self) -> dict[str, float]:
        return {k: statistics.mean(v for v in vs if v is not None) for k, vs in self.runs.items()
                if any(v is not None for v in vs)}

    def evaluator(self, rng: random.Random):  # type: ignore[no-untyped-def]
        def evaluate(index: int, config: dict[str, Any]) -> tuple:
            value = rng.choice(self.runs[key(config)])
            if value is None:
                return "failed in the grid", {}, 0.0, None
            return None, {"value": value}, 0.0, None

        return evaluate


def load(grid_name: str, objective: str) -> Replay | None:
    grid = GRIDS[grid_name]
    stored = json.loads(grid.data.read_text())
    space = Space.from_mapping(stored["space"])
    runs: dict[str, list[float | None]] = {}
    configs = {}
    for k, entry in stored["grid"].items():
        values = []
        for run in runs_of(entry):
            fields = {f: run.get(f) for f in Measurement.__dataclass_fields__ if f not in ("ok", "reason", "phases")}
            m = Measurement(run.get("failed") is None, run.get("failed"), **fields)
            values.append(score(m, objective, JOB_HOURS, MTBF_HOURS))
        runs[k], configs[k] = values, entry["config"]
    if objective == "ett" and all(v is None for vs in runs.values() for v in vs):
        return None  # (a grid measured without saves has no `ett`)
    return Replay(space, runs, configs)


def sampler_for(arm: str, space: Space, budget: int, seed: int, proxy_kind: str | None):  # type: ignore[no-untyped-def]
    if arm == "proxy":
        return ProxySampler(space, budget, seed, kind=proxy_kind)
    if arm == "tpe_defaults":
        return TPESampler(space, seed)
    return make_sampler(arm, space, budget, seed)  # tpe (as shipped), random


def run_arm(replay: Replay, arm: str, seed: int, budget: int, proxy_kind: str | None = None,
            confirm: tuple[int, int] = (CONFIRM_TOP, CONFIRM_RUNS)) -> float:
    """The arm's regret on this seed."""
    truth = replay.truth
    with tempfile.TemporaryDirectory() as tmp:
        log = TrialLog(Path(tmp))
        sampler = sampler_for(arm, replay.space, budget, seed, proxy_kind)
        search(replay.space, replay.evaluator(random.Random(7919 * seed + 1)), lambda m: m.get("value"), log, budget,
               sampler, per_round=3 if arm == "proxy" else 1, seed=seed, confirm_top=confirm[0], confirm_runs=confirm[1],
               report_rounds=False)
        winner = best(log, confirm[1])
    if winner is None:
        return 1.0
    return 1 - truth.get(key(winner.config), 0.0) / max(truth.values())


def sign_test(ours: list[float], theirs: list[float]) -> str:
    """Seeds where ours had the lower regret, the higher, ties; and the two-sided sign test's p over the untied."""
    from scipy.stats import binomtest

    lower = sum(a < b for a, b in zip(ours, theirs))
    higher = sum(a > b for a, b in zip(ours, theirs))
    p = binomtest(lower, lower + higher).pvalue if lower + higher else 1.0
    return f"lower in {lower}, higher in {higher}, tied in {len(ours) - lower - higher} seeds; sign test p = {p:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--grids", nargs="+", choices=sorted(GRIDS), default=["dlrm", "user"])
    parser.add_argument("--objectives", nargs="+", choices=["throughput", "ett"], default=["throughput", "ett"])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--proxy", default=None, help="the proxy model (default: the shipped one)")
    args = parser.parse_args()
    for grid_name in args.grids:
        for objective in args.objectives:
            replay = load(grid_name, objective)
            if replay is None:
                print(f"## grid {grid_name}, objective {objective}: not measured (the grid's job does not checkpoint)\n")
                continue
            truth = replay.truth
            best_key = max(truth, key=truth.get)  # type: ignore[arg-type]
            ranked = sorted(truth.values(), reverse=True)
            within = sum(v >= 0.95 * ranked[0] for v in ranked)
            budget = replay.space.size // 4
            print(f"## grid {grid_name}, objective {objective}: {len(truth)} of {replay.space.size} configurations ran; "
                  f"best {ranked[0]:.5g} ({replay.configs[best_key]}); {within} within 5 % of it; budget {budget} + "
                  f"{CONFIRM_TOP} x {CONFIRM_RUNS} confirmation runs\n")
            print("| seed | " + " | ".join(f"{a} regret" for a in args.arms) + " |")
            print("|---|" + "---|" * len(args.arms))
            regrets: dict[str, list[float]] = {a: [] for a in args.arms}
            for seed in range(args.seeds):
                row = []
                for arm in args.arms:
                    r = run_arm(replay, arm, seed, budget, args.proxy)
                    regrets[arm].append(r)
                    row.append(f"{r:.3f}")
                print(f"| {seed} | " + " | ".join(row) + " |", flush=True)
            print("\n| arm | within 5 % (seeds) | median regret | regret min–max |\n|---|---|---|---|")
            for arm, rs in regrets.items():
                print(f"| {arm} | {sum(r <= 0.05 for r in rs)} of {len(rs)} | {statistics.median(rs):.3f} | "
                      f"{min(rs):.3f}–{max(rs):.3f} |")
            if "proxy" in regrets:  # paired by seed: is the proxy's regret lower than each other arm's more often?
                for arm, rs in regrets.items():
                    if arm != "proxy":
                        print(f"proxy vs {arm}: {sign_test(regrets['proxy'], rs)}")
            print()


if __name__ == "__main__":
    main()
