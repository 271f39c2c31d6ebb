"""Where ETTStrategy's step goes against TrainPipelineSparseDist's, and what ``self.log`` and ETTMonitor cost (#33).

    .venv/bin/python benchmarks/throughput_phases.py [--rounds 5] [--steps 200]

throughput_vs_dmp.py measures ETTStrategy ÷ ``TrainPipelineSparseDist``; this says what the difference
is made of. Arms (throughput_job.py's, 2 gloo ranks, ``--phases``), in ``round_order`` each round:

* ``pipeline``: ``TrainPipelineSparseDist`` (and ``pipeline A/A``, the same again: the noise floor);
* ``lightning``: ETTStrategy as users run it (``self.log`` of the loss, ETTMonitor);
* ``lightning --no-log``: the same ``training_step`` without its ``self.log`` call;
* ``lightning --no-log --no-monitor``: and without ETTMonitor — Lightning's loop and ETTStrategy alone.

The last two do a little less than users do: they size what ``self.log`` and ETTMonitor cost, and are
not a throughput figure. Prints each round's steps/s and ratios to ``pipeline``, then per arm the median
time per step in each phase (rank 0; :class:`throughput_job.PhaseClock`) and the median ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.spread import aa_floor, median_range
from benchmarks.throughput_vs_dmp import rounds_of

ARMS: dict[str, tuple[str, ...]] = {
    "pipeline": (),
    "lightning": (),
    "lightning --no-log": ("--no-log",),
    "lightning --no-log --no-monitor": ("--no-log", "--no-monitor"),
    "pipeline A/A": (),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of all the arms (5: each arm in each position once)")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {}
    for r, order, results in rounds_of(ARMS, args.rounds, args.steps, ("--phases",)):
        base = results["pipeline"][-1]["step_s"]
        print(f"round {r} ({' -> '.join(order)}): "
              + ", ".join(f"{arm} {1 / results[arm][-1]['step_s']:.1f} steps/s" for arm in ARMS)
              + " -> ÷ pipeline: " + ", ".join(f"{arm} {base / results[arm][-1]['step_s']:.3f}"
                                               for arm in ARMS if arm != "pipeline"), flush=True)
    phases = sorted({phase for runs in results.values() for run in runs for phase in run["phases"]})
    print("\nms per step, rank 0, median of rounds (other = the step less the phases: the loop's own code, the loss, "
          "a strategy's per-step wrappers)")
    print(f"{'phase':48s}" + "".join(f"{arm:>34s}" for arm in ARMS))
    for phase in [*phases, "other", "step"]:
        row = []
        for arm in ARMS:
            values = [v for v in (_phase_ms(run, phase) for run in results[arm]) if v is not None]
            row.append(f"{statistics.median(values):34.3f}" if values else f"{'-':>34s}")
        print(f"{phase:48s}" + "".join(row))
    print()
    aa = [p["step_s"] / q["step_s"] for p, q in zip(results["pipeline"], results["pipeline A/A"], strict=True)]
    for arm in ARMS:
        if arm == "pipeline":
            continue
        ratios = [p["step_s"] / a["step_s"] for p, a in zip(results["pipeline"], results[arm], strict=True)]
        print(f"{arm} ÷ pipeline throughput, median (min-max) of {args.rounds}: {median_range(ratios, '.3f')}"
              f"; every round: {', '.join(f'{v:.3f}' for v in ratios)}")
    print(f"A/A floor: ±{aa_floor(aa):.3f}")


def _phase_ms(run: dict, phase: str) -> float | None:
    if phase == "step":
        return 1000 * run["step_s"]
    if phase == "other":
        return 1000 * (run["step_s"] - sum(run["phases"].values()))
    return 1000 * run["phases"][phase] if phase in run["phases"] else None


if __name__ == "__main__":
    main()
