"""What a checkpoint save costs the training loop: ours vs the synchronous save, Lightning's AsyncCheckpointIO and DCP.

    .venv/bin/python benchmarks/checkpoint_cost.py [--model ett embedding] [--gib 1] [--rounds 3] [--saves 5]

Two models (see checkpoint_job.py): ``ett`` — the headline, what this pack exists for: ETTStrategy
on 2 ranks, GIB GiB of TorchRec tables updated by the fused row-wise AdaGrad inside backward;
``embedding`` — one process, an ``nn.Embedding`` with sparse SGD. Every method runs in its own
job (checkpoint_job.py); each round runs all of them, the order rotated by one each round, plus
an A/A control: the synchronous reference run twice in the round. Each job makes a warm-up save
and then --saves measured saves; per save the slowest rank counts; per job the median save. Goals:
(a) ours blocked <= 5 % of the synchronous save (``torch.save``; ETTStrategy's synchronous DCP
write); (b) ours the lowest true cost (blocked + the slowdown of the steps that ran during the
write). Reported: the median over rounds with its range, and each method's rank in every round.

The machine is stated first: its memory-copy bandwidth (one large ``copy_``, what staging a
snapshot costs) and its disk-write bandwidth, so a slow machine can be told from a slow design.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from checkpoint_job import METHODS
from spread import aa_floor, against_floor, median_range, round_order


def measure(model: str, method: str, gib: float, root: Path, saves: int, extra: Sequence[str] = ()) -> dict:
    """One job; per save the slowest rank's blocked time and cost; the medians over the saves.

    ``extra``: more checkpoint_job.py arguments (``--phases``: rank 0's writer phases come back as ``phases``)."""
    import statistics

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    out = root.parent / f"{root.name}-{method}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env["PYTHONPATH"] = str(HERE.parent)
    try:
        proc = subprocess.run([sys.executable, str(HERE / "checkpoint_job.py"), "--model", model, "--method", method,
                               "--gib", str(gib), "--dir", str(root), "--out", str(out), "--saves", str(saves), *extra], env=env,
                              capture_output=True, text=True, timeout=1800, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{model}/{method} at {gib} GiB failed:\n{proc.stderr[-3000:]}")
        ranks = [json.loads(f.read_text()) for f in sorted(root.parent.glob(f"{out.name}*"))]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for f in root.parent.glob(f"{out.name}*"):
            f.unlink()
    per_save = [{k: max(r["saves"][i][k] for r in ranks) for k in ranks[0]["saves"][0]} for i in range(len(ranks[0]["saves"]))]
    row = {k: statistics.median(s[k] for s in per_save) for k in per_save[0]}
    return {**row, "saves": per_save, "ranks": len(ranks), "staging_bytes": ranks[0]["staging_bytes"],
            "phases": ranks[0].get("phases", {})}


def copy_bandwidth(gib: float = 1.0, rounds: int = 5) -> tuple[float, float]:
    """GB/s of one large ``dst.copy_(src)`` between two touched buffers (median, min over rounds)."""
    import statistics
    import time

    import torch

    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.zeros_like(src)
    rates = []
    for _ in range(rounds):
        t = time.perf_counter()
        dst.copy_(src)
        rates.append(src.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates), min(rates)


def disk_bandwidth(root: Path, mib: int = 512) -> float:
    """MB/s of writing ``mib`` MiB and fsyncing it where the checkpoints go."""
    import time

    block = os.urandom(2**20)
    path = root / "bandwidth.probe"
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.writelines(block for _ in range(mib))
        f.flush()
        os.fsync(f.fileno())
    rate = mib * 2**20 / (time.perf_counter() - t) / 1e6
    path.unlink()
    return rate


def run_model(model: str, gib: float, base: Path, rounds: int, saves: int) -> None:
    import statistics

    methods = list(METHODS[model])
    reference = methods[0]
    arms = methods + [f"{reference} A/A"]
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    ranks: dict[str, list[int]] = {m: [] for m in methods}
    for r in range(rounds):
        order = round_order(arms, r)
        for arm in order:
            runs[arm].append(measure(model, arm.split()[0], gib, base / f"{model}-{gib:g}gib", saves))
        by_cost = sorted(methods, key=lambda m: runs[m][-1]["cost_s"])
        for m in methods:
            ranks[m].append(by_cost.index(m) + 1)
        print(f"  round {r + 1}: order {', '.join(order)}; cost ranking {', '.join(by_cost)}", flush=True)
    step_ms = statistics.median(run["step_s"] for run in runs["ours"]) * 1000
    print(f"\n== {model}: {gib:g} GiB of state, {runs['ours'][0]['ranks']} rank(s); {rounds} rounds x {saves} measured saves "
          f"per method; median over rounds (min–max); step without a save {step_ms:.0f} ms ==")
    print(f"{'method':<22}{'(a) blocked s':>24}{'in next step':>14}{'(b) cost s':>24}{'write s':>10}{'steps':>7}"
          f"  cost rank per round")
    for arm in arms:
        rs = runs[arm]
        rank = ",".join(map(str, ranks[arm])) if arm in ranks else "-"
        blocked, cost = median_range([x["blocked_s"] for x in rs], ".3f"), median_range([x["cost_s"] for x in rs], ".3f")
        print(f"{arm:<22}{blocked:>24}{statistics.median(x['waited_s'] for x in rs):>14.3f}"
              f"{cost:>24}{statistics.median(x['write_s'] for x in rs):>10.2f}"
              f"{statistics.median(x['steps_during_write'] for x in rs):>7.0f}  {rank}")
    per_round = [o["blocked_s"] / ref["blocked_s"] for o, ref in zip(runs["ours"], runs[reference])]
    aa_blocked = [a["blocked_s"] / b["blocked_s"] for a, b in zip(runs[reference], runs[f"{reference} A/A"])]
    aa_cost = [a["cost_s"] / b["cost_s"] for a, b in zip(runs[reference], runs[f"{reference} A/A"])]
    print(f"(a) ours blocked / {reference} blocked, per round: {median_range(per_round, '.3f')}  (goal <= 0.05)")
    print(f"    A/A: {reference} / its repeat, blocked {median_range(aa_blocked, '.3f')}, cost {median_range(aa_cost, '.3f')}")
    ranking = sorted(methods, key=lambda m: statistics.median(x["cost_s"] for x in runs[m]))
    firsts = sum(1 for k in ranks["ours"] if k == 1)
    print(f"(b) ranking by median cost: {', '.join(ranking)}; ours first in {firsts} of {rounds} rounds (goal: ours first)")
    runner_up = next(m for m in ranking if m != "ours")
    gap = [o["cost_s"] / x["cost_s"] for o, x in zip(runs["ours"], runs[runner_up])]
    floor = aa_floor(aa_cost)
    verdict = against_floor(gap, floor)
    print(f"    ours / {runner_up} (the best other method) cost, per round: {median_range(gap, '.3f')}; "
          f"A/A floor ±{floor:.3f}: {verdict}")
    print("    every run's per-save cost (s): " + "; ".join(
        f"{arm} " + " | ".join("/".join(f"{s['cost_s']:.2f}" for s in run["saves"]) for run in runs[arm]) for arm in arms))
    staged = runs["ours"][0]["staging_bytes"] / 2**30
    print(f"    staging buffers held by ours: {staged:.2f} GiB per rank (host RAM; pinned on CUDA)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=tuple(METHODS), default=["ett", "embedding"])
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saves", type=int, default=5, help="measured saves per job (the median is taken)")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary directory)")
    args = parser.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ett-ckpt-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    median_bw, low_bw = copy_bandwidth()
    print(f"machine: {os.cpu_count()} CPUs; memory copy (1 GiB copy_, 5 rounds) {median_bw:.1f} GB/s median, "
          f"{low_bw:.1f} GB/s slowest; disk write + fsync {disk_bandwidth(base):.0f} MB/s ({base})", flush=True)
    for model in args.model:
        for gib in args.gib:
            run_model(model, gib, base, args.rounds, args.saves)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
