"""ETTStrategy's throughput at two commits on one VM, with TorchRec's ``TrainPipelineSparseDist`` as the yardstick (#33).

    git worktree add /tmp/old <commit>; cp benchmarks/throughput_job.py /tmp/old/benchmarks/
    .venv/bin/python benchmarks/throughput_commits.py --old /tmp/old [--rounds 8] [--steps 200]

Why: throughput_vs_dmp.py's ratio moved between VMs and commits; this says whether the package code did it.
Arms, in ``round_order`` each round: ``pipeline`` (TrainPipelineSparseDist, this tree), ``lightning@head``
(ETTStrategy, this tree's package), ``lightning@old`` (the package of the tree at ``--old``, run by this
tree's throughput_job.py copied there, so only the package differs), ``pipeline A/A``. Prints every round,
each Lightning arm ÷ TrainPipelineSparseDist, and head ÷ old.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.spread import round_order
from benchmarks.throughput_vs_dmp import step_time

ARMS = ["pipeline", "lightning@head", "lightning@old", "pipeline A/A"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, type=Path, help="a worktree of the other commit")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    trees = {"head": HERE.parent, "old": args.old.resolve()}
    results: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = round_order(ARMS, r)
            for arm in order:
                mode, _, tree = arm.partition("@")
                results[arm].append(step_time(mode, Path(tmp) / f"{arm.replace(' ', '_').replace('/', '_')}{r}.json",
                                              args.steps, root=trees[tree or "head"]))
            base = results["pipeline"][-1]
            print(f"round {r} ({' -> '.join(order)}): " + ", ".join(
                f"{arm} {1 / results[arm][-1]:.1f}/s ÷TPSD {base / results[arm][-1]:.3f}" for arm in ARMS), flush=True)
    for arm in ARMS[1:]:
        ratios = [p / x for p, x in zip(results["pipeline"], results[arm], strict=True)]
        print(f"{arm} ÷ TPSD median {statistics.median(ratios):.3f} min-max {min(ratios):.3f}-{max(ratios):.3f} every: "
              + ", ".join(f"{v:.3f}" for v in ratios))
    head_old = [o / h for h, o in zip(results["lightning@head"], results["lightning@old"], strict=True)]
    print(f"ETTStrategy head ÷ old throughput, median {statistics.median(head_old):.3f} every: "
          + ", ".join(f"{v:.3f}" for v in head_old))


if __name__ == "__main__":
    main()
