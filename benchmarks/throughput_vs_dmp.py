"""Training throughput: ETTStrategy under Lightning vs hand-written TorchRec loops (TrainPipelineSparseDist, plain DMP).

    .venv/bin/python benchmarks/throughput_vs_dmp.py [--pairs 10] [--steps 200]

Same model, data, sharding and optimizers (see throughput_job.py), 2 gloo ranks each; the Lightning
arms keep what users keep (``self.log`` of the loss, ETTMonitor). Each round runs the arms back to back
in ``round_order`` (a Williams design, so no arm always runs first or after the same arm) and compares
ETTStrategy's steps/s with each other arm's in that round. A step's time is the total time over
the steps after the warm-up divided by their number. An A/A control runs the plain DMP loop twice
per round; its ratio sizes the noise. Prints every round, then the median and the interquartile
range of each ratio. Goals (#33): ETTStrategy / TrainPipelineSparseDist >= 0.97 and
ETTStrategy / plain DMP loop >= 1.0, medians. ``ETTStrategy(pipeline=False)`` is measured too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.spread import round_order

ARMS = ("dmp", "pipeline", "lightning", "lightning_plain", "dmp A/A")
NAMES = {"dmp": "plain DMP loop", "pipeline": "TrainPipelineSparseDist", "lightning": "ETTStrategy",
         "lightning_plain": "ETTStrategy(pipeline=False)", "dmp A/A": "plain DMP loop again"}


def job_result(mode: str, out: Path, steps: int, extra: tuple[str, ...] = (), tries: int = 2,
               root: Path = HERE.parent) -> dict[str, Any]:
    """One run of ``mode``'s job (its first word; ``extra``: more throughput_job.py flags): what rank 0 wrote.
    ``root``: the source tree whose job script and package run (another commit's worktree in throughput_commits.py).
    A crashed run is reported and run again once (a rank of the hand-written loop has been seen to abort at
    exit in gloo's teardown); a second crash stops the benchmark."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_") and k != "OMP_NUM_THREADS"}  # same threads
    env["PYTHONPATH"] = str(root)  # the job script puts its own tree first on sys.path too
    for attempt in range(1, tries + 1):
        out.unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, str(root / "benchmarks" / "throughput_job.py"), "--mode", mode.split()[0], "--out",
                               str(out), "--steps", str(steps), *extra], check=False, env=env, capture_output=True,
                              text=True, timeout=900)
        if proc.returncode == 0:
            return json.loads(out.read_text())
        if attempt == tries:
            raise RuntimeError(proc.stderr[-3000:])
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1:]
        print(f"  {mode} crashed (exit {proc.returncode}: {last}); running it again", flush=True)
    raise AssertionError("unreachable")


def rounds_of(arms: dict[str, tuple[str, ...]], rounds: int, steps: int,
              common: tuple[str, ...] = ()) -> Iterator[tuple[int, list[str], dict[str, list[dict[str, Any]]]]]:
    """Run every arm (name -> its throughput_job.py flags, after ``common``) once per round in ``round_order``;
    after each round yield ``(round, its order, every arm's results so far)``."""
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = round_order(list(arms), r)
            for arm in order:
                out = Path(tmp) / f"{arm.replace(' ', '_').replace('/', '_')}{r}.json"
                results[arm].append(job_result(arm, out, steps, (*common, *arms[arm])))
            yield r, order, results


def step_time(mode: str, out: Path, steps: int, root: Path = HERE.parent) -> float:
    """One run of ``mode``'s job (from the tree at ``root``): the time per step (total over the steps after the
    warm-up / their number)."""
    return float(job_result(mode, out, steps, root=root)["step_s"])


def spread(values: list[float]) -> str:
    """Median and interquartile range."""
    if len(values) < 2:
        return f"{values[0]:.3f}"
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return f"{statistics.median(values):.3f} (IQR {q1:.3f}-{q3:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10, help="rounds of all the arms (10: a balanced design of 5 arms)")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    ratios: dict[str, list[float]] = {"pipeline": [], "dmp": [], "lightning_plain": []}
    control: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = round_order(ARMS, pair)
            step = {arm: step_time(arm, Path(tmp) / f"{arm.replace(' ', '_').replace('/', '_')}{pair}.json", args.steps)
                    for arm in order}
            control.append(step["dmp"] / step["dmp A/A"])
            for hand, values in ratios.items():
                values.append(step[hand] / step["lightning"])  # steps/s ours / steps/s hand-written
            print(f"round {pair} ({' -> '.join(order)}): " + ", ".join(f"{NAMES[a]} {1 / step[a]:.1f} steps/s" for a in ARMS)
                  + f" -> ETTStrategy/pipeline {ratios['pipeline'][-1]:.3f}, ETTStrategy/DMP {ratios['dmp'][-1]:.3f}"
                  + f", ETTStrategy/unpipelined {ratios['lightning_plain'][-1]:.3f}, A/A {control[-1]:.3f}",
                  flush=True)
    print(f"ETTStrategy / TrainPipelineSparseDist throughput, median of {args.pairs} rounds: {spread(ratios['pipeline'])}"
          "  (goal >= 0.97)")
    print(f"ETTStrategy / plain DMP loop throughput, median of {args.pairs} rounds: {spread(ratios['dmp'])}  (goal >= 1.0)")
    print(f"ETTStrategy / ETTStrategy(pipeline=False) throughput, median of {args.pairs} rounds: "
          f"{spread(ratios['lightning_plain'])}")
    print(f"A/A: plain DMP loop again / plain DMP loop throughput, median of {args.pairs} rounds: {spread(control)}")


if __name__ == "__main__":
    main()
