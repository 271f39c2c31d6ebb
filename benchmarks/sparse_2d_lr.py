"""What 2D sparse parallelism does to the embedding learning rate: 1D vs 2D loss curves at the same LR and at LR x R.

    .venv/bin/python benchmarks/sparse_2d_lr.py [--rounds 3] [--steps 300] [--worlds 4 8] [--lr 0.05]
                                               [--optimizer row_wise_adagrad|sgd]

In 2D each of the R = N/K replicas of a table updates it from its own sharding group's share of
the batch, and the replicas are then averaged (TorchRec's ``DMPCollection`` semantics). Whether that shrinks the
embedding learning rate depends on how the table gradient is scaled: TorchRec divides the pooled
embeddings' gradient by the all-to-all's world size (``comm_ops.set_gradient_division``, on by
default), so a 1D table sees the mean over N ranks and a 2D replica the mean over its K; for SGD
synced every step the average of the R replica updates is then 1D's update. Row-wise AdaGrad is not
linear: each replica normalises by an accumulator of its own, noisier, gradients. This measures it
rather than arguing it.

Each round is one launch of tests/scripts/sparse_2d_job.py (the example DLRM, 26 tables x 500 x 8,
fused row-wise AdaGrad, batch 32 per rank, learnable step-keyed data: the label depends on a dense
feature and on the parity of the first table's id) on N ranks, with that round's seed for the
model's initialization and the data. One 1D step is trained and saved; every arm then resumes from
that checkpoint, so all arms start from the same weights and see the same batches, and differ only
in how the tables are updated:

* **1D** at ``--lr``; **1D A/A**: the same again (the noise floor of the comparison);
* **2D** K = 2 (R = N/2), replica sync every step (DMPCollection's default), at ``--lr``;
* **2D x R** and **2D x sqrt(R)**: the same with ``ETTStrategy(replica_lr_scale="replicas")`` (lr x R, what
  ``"auto"`` picks for row-wise AdaGrad) and ``replica_lr_scale=sqrt(R)`` (with row-wise AdaGrad the noisier
  per-replica gradients inflate the accumulator, which argues for sqrt(R) rather than R).

Measured: the training loss on each step's new batch (progressive validation: no batch is seen
twice), averaged over ranks, per quarter of the run; and the held-out loss at the end (4 unseen
batches per rank). Figures: per round, each arm's held-out loss and last-quarter loss ÷ 1D's;
medians (min-max) over rounds; the arms' order per round from ``round_order``.
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

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from spread import aa_floor, median_range, round_order

REPO = HERE.parent
JOB = REPO / "tests" / "scripts" / "sparse_2d_job.py"
LIGHTNING = Path(sys.executable).parent / "lightning"
QUARTERS = 4


def arms(world: int, lr: float, steps: int) -> list[dict]:
    replicas = world // 2
    return [{"arm": "1D", "k": None, "lr": lr}, {"arm": "1D A/A", "k": None, "lr": lr},
            {"arm": "2D", "k": 2, "lr": lr},
            {"arm": f"2D replica_lr_scale='replicas' (lr x {replicas})", "k": 2, "lr": lr, "lr_scale": "replicas"},
            {"arm": f"2D x sqrt(R) (lr x {replicas ** 0.5:.2f})", "k": 2, "lr": lr, "lr_scale": replicas ** 0.5}]


def run_round(world: int, seed: int, args: argparse.Namespace, out: Path) -> dict[str, dict]:
    ordered = round_order(arms(world, args.lr, args.steps), seed)
    start = {"name": "start", "k": None, "steps": 1, "save": True, "init_seed": seed, "data_seed": seed, "lr": args.lr}
    start["fused_optimizer"] = args.optimizer
    fits = [start] + [{"name": f"arm{i}", "k": a["k"], "interval": 1, "lr": a["lr"], "lr_scale": a.get("lr_scale", 1.0),
                       "steps": 1 + args.steps,
                       "resume": "start", "data_seed": seed, "fused_optimizer": args.optimizer} for i, a in enumerate(ordered)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([str(LIGHTNING), "run", "--devices", str(world), "--max-restarts", "0", "--run-dir",
                           str(out / "run"), str(JOB), "--devices", str(world), "--out", str(out), "--fits", json.dumps(fits)],
                          env=env, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    results = {}
    for i, arm in enumerate(ordered):
        ranks = [torch.load(out / f"arm{i}" / f"rank{r}.pt", weights_only=False) for r in range(world)]
        curve = [statistics.mean(step) for step in zip(*(r["losses"] for r in ranks), strict=True)]
        size = len(curve) // QUARTERS
        results[arm["arm"]] = {"held_out": ranks[0]["held_out_loss"], "order": ordered.index(arm),
                               "quarters": [statistics.mean(curve[q * size:(q + 1) * size]) for q in range(QUARTERS)]}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", default="row_wise_adagrad", choices=["row_wise_adagrad", "sgd"])
    args = parser.parse_args()
    for world in args.worlds:
        rounds = []
        for seed in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix=f"lr-{world}-{seed}-") as tmp:
                rounds.append(run_round(world, seed, args, Path(tmp)))
            print(json.dumps({"world": world, "seed": seed, **rounds[-1]}), flush=True)
        names = list(rounds[0])
        print(f"\nN = {world}, K = 2 (R = {world // 2}), {args.optimizer}, {args.steps} steps, lr {args.lr}: per arm, "
              f"median (min-max) over {args.rounds} rounds")
        print("| arm | training loss per quarter | held-out loss | held-out ÷ 1D | last quarter ÷ 1D |")
        print("|---|---|---|---|---|")
        for name in names:
            quarters = " / ".join(f"{statistics.median(r[name]['quarters'][q] for r in rounds):.4f}" for q in range(QUARTERS))
            held = [r[name]["held_out"] for r in rounds]
            held_ratio = [r[name]["held_out"] / r["1D"]["held_out"] for r in rounds]
            last_ratio = [r[name]["quarters"][-1] / r["1D"]["quarters"][-1] for r in rounds]
            print(f"| {name} | {quarters} | {median_range(held, '.4f')} | {median_range(held_ratio, '.3f')} | "
                  f"{median_range(last_ratio, '.3f')} |")
        floor = aa_floor([r["1D A/A"]["held_out"] / r["1D"]["held_out"] for r in rounds])
        print(f"A/A floor (held-out): ±{floor:.4f}")


if __name__ == "__main__":
    main()
