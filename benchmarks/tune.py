"""`lightning-ett tune` vs random search on the example DLRM's knobs, against the measured grid.

    .venv/bin/python benchmarks/tune.py [--seeds 5] [--measure-grid] [--steps 60]

1. The ground truth: every configuration of benchmarks/tune_space.yaml (48) run once as a real
   trial — ``lightning run`` of examples/dlrm_example.py on 2 gloo ranks with
   benchmarks/tune_dlrm.yaml, measured from its ledger exactly as ``tune`` measures — kept in
   benchmarks/data/tune_grid.json (``--measure-grid`` measures it again; ~15 min).
2. For each seed, ``tune``'s search (the same code, :func:`lightning_ett.tune.search.search`) with a
   budget of a quarter of the grid, its trials answered from the grid instead of run again; and
   random search with the same budget. For each: is the best configuration it ran within 5 % of
   the grid's best throughput, and how well does its proxy (the same model, fitted on the trials it
   ran) rank the configurations it did not run (Spearman against the grid)?

Goals: ours within 5 % in >= 4 of 5 seeds, median rank correlation >= 0.8, both better than random.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
from lightning_ett.tune.proxy import Proxy, spearman
from lightning_ett.tune.search import ok_trials, search
from lightning_ett.tune.space import Space, key
from lightning_ett.tune.trials import TrialLog, TrialRunner

GRID = HERE / "data" / "tune_grid.json"
SPACE = HERE / "tune_space.yaml"
CONFIG = HERE / "tune_dlrm.yaml"


def measure_grid(space: Space, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ett-tune-grid-") as tmp:
        runner = TrialRunner(REPO / "examples" / "dlrm_example.py",
                             ["fit", "--config", str(CONFIG), "--trainer.callbacks+=lightning_ett.ETTMonitor"],
                             steps, 2, Path(tmp))
        grid = {}
        for i, config in enumerate(space.configurations()):
            reason, measurements, seconds, _ = runner(i, config)
            grid[key(config)] = {"config": config, "failed": reason, "throughput": measurements.get("throughput"),
                                 "step_s": measurements.get("step_s"), "startup_s": measurements.get("startup_s"),
                                 "seconds": seconds}
            print(f"grid {i + 1}/{space.size}: {config} -> {measurements.get('throughput') or reason} ({seconds:.0f} s)",
                  flush=True)
    return {"date": time.strftime("%Y-%m-%d"), "steps": steps, "devices": 2, "space": space.options, "grid": grid}


def replay(grid: dict):  # type: ignore[no-untyped-def]
    def evaluate(index: int, config: dict) -> tuple:
        entry = grid[key(config)]
        return entry["failed"], {"ok": entry["failed"] is None, "throughput": entry["throughput"]}, 0.0, None

    return evaluate


def untried_rank_correlation(space: Space, grid: dict, tried: list[dict], values: list[float], seed: int) -> float | None:
    """The proxy fitted on these trials, scored on every configuration they did not include."""
    done = {key(c) for c in tried}
    rest = [e for k, e in grid.items() if k not in done and e["throughput"]]
    if len(tried) < 2 or not rest:
        return None
    predicted = Proxy(space, log_target=True, seed=seed).fit(tried, values).predict([e["config"] for e in rest])
    return spearman(predicted, [e["throughput"] for e in rest])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--measure-grid", action="store_true", help="measure the grid again (else the stored one)")
    parser.add_argument("--steps", type=int, default=60, help="steps per grid trial")
    args = parser.parse_args()
    space = Space.load(SPACE)
    if args.measure_grid or not GRID.exists():
        GRID.parent.mkdir(exist_ok=True)
        GRID.write_text(json.dumps(measure_grid(space, args.steps), indent=1) + "\n")
    stored = json.loads(GRID.read_text())
    grid = stored["grid"]
    measured = {k: e["throughput"] for k, e in grid.items() if e["throughput"]}
    best_key = max(measured, key=measured.get)
    best = measured[best_key]
    budget = space.size // 4
    print(f"grid: {len(measured)} of {space.size} configurations measured ({stored['date']}, {stored['steps']} steps each); "
          f"best {best:.0f} samples/s: {grid[best_key]['config']}; budget {budget}\n")
    print("| seed | tune: best found (÷ grid best) | tune: untried Spearman | random: best found | random: untried Spearman |")
    print("|---|---|---|---|---|")
    ours_hits = random_hits = 0
    ours_rho, random_rho = [], []
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory() as tmp:
            log = TrialLog(Path(tmp))
            search(space, replay(grid), lambda m: m.get("throughput"), log, budget, seed=seed)
            ok = ok_trials(log)
            found = max(t.objective for t in ok) / best
            rho = untried_rank_correlation(space, grid, [t.config for t in ok], [t.objective for t in ok], seed)
        rng = random.Random(10_000 + seed)
        picked = rng.sample(list(grid), budget)
        values = [(grid[k]["config"], grid[k]["throughput"]) for k in picked if grid[k]["throughput"]]
        r_found = max(v for _, v in values) / best
        r_rho = untried_rank_correlation(space, grid, [c for c, _ in values], [v for _, v in values], seed)
        ours_hits += found >= 0.95
        random_hits += r_found >= 0.95
        ours_rho.append(rho if rho is not None else float("nan"))
        random_rho.append(r_rho if r_rho is not None else float("nan"))
        print(f"| {seed} | {found:.3f} | {rho:.3f} | {r_found:.3f} | {r_rho:.3f} |")
    print(f"\nwithin 5 % of the grid's best: tune {ours_hits} of {args.seeds} (goal >= 4), random {random_hits} of "
          f"{args.seeds}")
    print(f"median rank correlation on the untried: tune {statistics.median(ours_rho):.3f} (goal >= 0.8), random "
          f"{statistics.median(random_rho):.3f}")


if __name__ == "__main__":
    main()
