"""What ETTStrategy's ``gc_freeze`` changes in the training steps: Python's full collections, and the time per step (#33).

    .venv/bin/python benchmarks/throughput_gc.py [--rounds 6] [--steps 200]

throughput_vs_dmp.py's Lightning arm once lost ~0.25 s of its 200-step window to one full (generation-2)
collection of the ~400,000 objects left by start-up, and TorchRec's loop did not. Arms
(throughput_job.py's, 2 gloo ranks, ``--gc-log``), in ``round_order`` each round:

* ``lightning``: ETTStrategy as users run it (``gc_freeze=True``, the default);
* ``lightning --no-gc-freeze``: the same with ``gc_freeze=False``, and again (A/A: the noise floor);
* ``pipeline``: TorchRec's ``TrainPipelineSparseDist``, which changes nothing in the collector (for reference).

Same model, data, steps and callbacks in every Lightning arm; only the collector's handling differs.
Prints each round's steps/s and rank 0's collections during the timed steps (generation-2 ones, and the
time in all), then the medians: ``gc_freeze`` on ÷ off throughput (goal: > 1, beyond the A/A).
The collection before the first step that ``gc_freeze`` adds is start-up time, outside this window
(``e2e_ett.py`` counts it).
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
    "lightning": (),
    "lightning --no-gc-freeze": ("--no-gc-freeze",),
    "lightning --no-gc-freeze A/A": ("--no-gc-freeze",),
    "pipeline": (),
}


def collections(run: dict) -> str:
    full = [(step, round(ms)) for gen, step, ms in run["gc"] if gen == 2]
    return f"{len(run['gc'])} collections, {sum(ms for _, _, ms in run['gc']):.0f} ms; full (step, ms): {full}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {}
    for r, order, results in rounds_of(ARMS, args.rounds, args.steps, ("--gc-log",)):
        print(f"round {r} ({' -> '.join(order)}):", flush=True)
        for arm in ARMS:
            run = results[arm][-1]
            print(f"  {arm}: {1 / run['step_s']:.1f} steps/s; {collections(run)}", flush=True)
    off = results["lightning --no-gc-freeze"]
    ratio = [o["step_s"] / on["step_s"] for on, o in zip(results["lightning"], off, strict=True)]
    aa = [o["step_s"] / a["step_s"] for o, a in zip(off, results["lightning --no-gc-freeze A/A"], strict=True)]
    tpsd = [p["step_s"] / on["step_s"] for on, p in zip(results["lightning"], results["pipeline"], strict=True)]
    print(f"gc_freeze on ÷ off throughput, median (min-max) of {args.rounds}: {median_range(ratio, '.3f')}; "
          f"every round: {', '.join(f'{v:.3f}' for v in ratio)}")
    print(f"A/A (off again ÷ off): {median_range(aa, '.3f')}: floor ±{aa_floor(aa):.3f}")
    print(f"ETTStrategy (gc_freeze on) ÷ TrainPipelineSparseDist, for reference: {median_range(tpsd, '.3f')}")
    for arm in ARMS:
        full = [sum(1 for gen, _, _ in run["gc"] if gen == 2) for run in results[arm]]
        ms = [sum(ms for _, _, ms in run["gc"]) for run in results[arm]]
        print(f"{arm}: full collections in the window per run {full}; collection ms per run, median "
              f"{statistics.median(ms):.1f}")


if __name__ == "__main__":
    main()
