"""Start-up time from ``Trainer.fit`` to the first training step: ETTStrategy overlapped vs sequential.

    .venv/bin/python benchmarks/startup_overlap.py [--pairs 3] [--tables 150]

Each run is a fresh 2-rank job (Lightning's launcher, gloo) of a DLRM with many tables, so
that planning and data-set opening take real time. Four arms alternate in every round:
sequential start-up; overlapped; overlapped with a fresh plan cache (the first start of a
job: the later-spawned rank finds the plan rank 0 wrote); overlapped with a warm cache (a
restart). Per rank it prints fit -> first step and, from the sequential runs' phases, the
ideal max(parts)/sum(parts) for the overlapped window; then the job (slowest rank) medians.
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
sys.path.insert(0, str(HERE.parent))
from lightning_ett.instrument.ledger import read_ledger

WINDOW = ("model_init", "sharding_plan", "data_init")


def one_run(out: Path, overlap: bool, tables: int, plan_cache: Path | None = None) -> dict[int, dict[str, float]]:
    """Per rank: fit -> first step, and the strategy's process-group and start-up-work spans."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env["PYTHONPATH"] = str(HERE.parent)
    argv = [sys.executable, str(HERE / "startup_job.py"), "--out", str(out), "--overlap", str(int(overlap)),
            "--tables", str(tables)]
    argv += ["--plan-cache", str(plan_cache)] if plan_cache else []
    proc = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    ranks = {}
    for ledger in read_ledger(out / "ett"):
        fit_called = json.loads((out / f"fit_called_rank{ledger.rank}.json").read_text())["fit_called"]
        events = ledger.events
        first_step = min(e["start"] for e in events if e["phase"] == "train")
        # ETTMonitor times `strategy.setup_environment` as process_group_init: the strategy's
        # start-up (process group + overlapped work) lies between fit and its end.
        setup_hook = max(e["end"] for e in events if e["phase"] == "process_group_init")
        inside = [e for e in events if e["start"] >= fit_called and e["end"] <= setup_hook]
        ranks[ledger.rank] = {
            "to_first_step": first_step - fit_called,
            "process_group": sum(e["end"] - e["start"] for e in inside if e["phase"] == "process_group_init"),
            "work": sum(e["end"] - e["start"] for e in inside if e["phase"] in WINDOW),
        }
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--tables", type=int, default=150)
    args = parser.parse_args()
    arms = ("sequential", "overlapped", "overlapped+fresh cache", "overlapped+warm cache")
    runs: dict[str, list[dict[int, dict[str, float]]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm-cache"
        one_run(Path(tmp) / "prime", True, args.tables, warm)  # fills the warm cache
        for pair in range(args.pairs):
            runs["sequential"].append(one_run(Path(tmp) / f"seq{pair}", False, args.tables))
            runs["overlapped"].append(one_run(Path(tmp) / f"ovl{pair}", True, args.tables))
            fresh = one_run(Path(tmp) / f"fresh{pair}", True, args.tables, Path(tmp) / f"cache{pair}")
            runs["overlapped+fresh cache"].append(fresh)
            runs["overlapped+warm cache"].append(one_run(Path(tmp) / f"warm{pair}", True, args.tables, warm))
            seq, ovl = runs["sequential"][-1], runs["overlapped"][-1]
            print(f"pair {pair}: " + "; ".join(
                f"rank {r}: {seq[r]['to_first_step']:.2f}s sequential (process group {seq[r]['process_group']:.2f}s, "
                f"plan+model+data {seq[r]['work']:.2f}s) vs {ovl[r]['to_first_step']:.2f}s overlapped" for r in sorted(seq)))
    med = statistics.median
    for rank in sorted(runs["sequential"][0]):
        seq = med(run[rank]["to_first_step"] for run in runs["sequential"])
        ovl = med(run[rank]["to_first_step"] for run in runs["overlapped"])
        pg = med(run[rank]["process_group"] for run in runs["sequential"])
        work = med(run[rank]["work"] for run in runs["sequential"])
        ideal = (seq - min(pg, work)) / seq
        print(f"rank {rank}: fit->first step sequential {seq:.2f}s, overlapped {ovl:.2f}s, ratio {ovl / seq:.3f} "
              f"(ideal, hiding min(process group {pg:.2f}s, work {work:.2f}s): {ideal:.3f})")
    job = {arm: med(max(r["to_first_step"] for r in run.values()) for run in runs[arm]) for arm in arms}
    for arm in arms:
        print(f"job (slowest rank) fit->first step, {arm}: {job[arm]:.2f}s, "
              f"ratio to sequential {job[arm] / job['sequential']:.3f}")


if __name__ == "__main__":
    main()
