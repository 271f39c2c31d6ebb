"""Training throughput: ETTStrategy under Lightning vs a hand-written TorchRec DMP loop.

    .venv/bin/python benchmarks/throughput_vs_dmp.py [--pairs 3] [--steps 200]

Same model, data, sharding and optimizers (see throughput_job.py), 2 gloo ranks each,
alternating A/B pairs; prints each pair's steps/s ratio and the median. Goal: >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def step_time(mode: str, out: Path, steps: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env["PYTHONPATH"] = str(HERE.parent)
    proc = subprocess.run([sys.executable, str(HERE / "throughput_job.py"), "--mode", mode, "--out", str(out),
                           "--steps", str(steps)], check=False, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(out.read_text())["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            hand = step_time("dmp", Path(tmp) / f"dmp{pair}.json", args.steps)
            ours = step_time("lightning", Path(tmp) / f"ett{pair}.json", args.steps)
            ratios.append(hand / ours)  # steps/s ours / steps/s hand-written
            print(f"pair {pair}: hand-written DMP {1 / hand:.1f} steps/s, ETTStrategy {1 / ours:.1f} steps/s "
                  f"-> ratio {ratios[-1]:.3f}")
    print(f"ETTStrategy / hand-written DMP throughput (median of {args.pairs} pairs): "
          f"{statistics.median(ratios):.3f}  (goal >= 0.95)")


if __name__ == "__main__":
    main()
