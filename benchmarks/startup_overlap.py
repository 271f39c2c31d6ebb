"""Start-up time from ``Trainer.fit`` to the first training step: ETTStrategy overlapped vs sequential.

    .venv/bin/python benchmarks/startup_overlap.py [--rounds 3] [--tables 150] [--launcher lightning-run|trainer]

Each run is a fresh 2-rank job (gloo) of a DLRM with many tables, so that planning and data-set
opening take real time, started by ``lightning run`` (default: both ranks start at once and plan
at once, as under any production launcher) or by the Trainer's own launcher (``trainer``: rank 0
spawns rank 1 when it reaches ``fit``). Five arms, their order rotated every round: sequential
start-up; overlapped; overlapped with a fresh plan cache (the first start of a job); overlapped
with a warm cache (a restart); sequential again (the A/A control: the noise floor). Per rank it
prints fit -> first step and, from the sequential runs' phases, the ideal max(parts)/sum(parts)
for the overlapped window; then the job (slowest rank) medians (min–max) over rounds.
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
from benchmarks.spread import aa_floor, against_floor, median_range, round_order
from lightning_ett.instrument.ledger import read_ledger

BIN = Path(sys.executable).parent
ARMS = ("sequential", "overlapped", "overlapped+fresh cache", "overlapped+warm cache", "sequential A/A")

WINDOW = ("model_init", "sharding_plan", "data_init")


def one_run(out: Path, overlap: bool, tables: int, launcher: str, plan_cache: Path | None = None
            ) -> dict[int, dict[str, float]]:
    """Per rank: fit -> first step, and the strategy's process-group and start-up-work spans."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env["PYTHONPATH"] = str(HERE.parent)
    job = [str(HERE / "startup_job.py"), "--out", str(out), "--overlap", str(int(overlap)), "--tables", str(tables)]
    job += ["--plan-cache", str(plan_cache)] if plan_cache else []
    if launcher == "lightning-run":
        argv = [str(BIN / "lightning"), "run", "--devices", "2", "--max-restarts", "0", "--run-dir", str(out / "ett"), *job]
    else:
        argv = [sys.executable, *job]
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tables", type=int, default=150)
    parser.add_argument("--launcher", choices=["lightning-run", "trainer"], default="lightning-run")
    args = parser.parse_args()
    runs: dict[str, list[dict[int, dict[str, float]]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm-cache"
        one_run(Path(tmp) / "prime", True, args.tables, args.launcher, warm)  # fills the warm cache
        for r in range(args.rounds):
            order = round_order(ARMS, r)
            for i, arm in enumerate(order):
                cache = {"overlapped+fresh cache": Path(tmp) / f"cache{r}", "overlapped+warm cache": warm}.get(arm)
                runs[arm].append(one_run(Path(tmp) / f"r{r}-{i}", not arm.startswith("sequential"), args.tables,
                                         args.launcher, cache))
            seq, ovl = runs["sequential"][-1], runs["overlapped"][-1]
            print(f"round {r + 1} ({', '.join(order)}): " + "; ".join(
                f"rank {k}: {seq[k]['to_first_step']:.2f}s sequential (process group {seq[k]['process_group']:.2f}s, "
                f"plan+model+data {seq[k]['work']:.2f}s) vs {ovl[k]['to_first_step']:.2f}s overlapped" for k in sorted(seq)),
                flush=True)
    med = statistics.median
    for rank in sorted(runs["sequential"][0]):
        seq = med(run[rank]["to_first_step"] for run in runs["sequential"])
        ovl = med(run[rank]["to_first_step"] for run in runs["overlapped"])
        pg = med(run[rank]["process_group"] for run in runs["sequential"])
        work = med(run[rank]["work"] for run in runs["sequential"])
        ideal = (seq - min(pg, work)) / seq
        print(f"rank {rank}: fit->first step sequential {seq:.2f}s, overlapped {ovl:.2f}s, ratio {ovl / seq:.3f} "
              f"(ideal, hiding min(process group {pg:.2f}s, work {work:.2f}s): {ideal:.3f})")
    job = {arm: [max(r["to_first_step"] for r in run.values()) for run in runs[arm]] for arm in ARMS}
    aa = [a / b for a, b in zip(job["sequential A/A"], job["sequential"])]
    floor = aa_floor(aa)
    print(f"launcher: {args.launcher}; job (slowest rank) fit->first step over {args.rounds} rounds, median (min–max); "
          f"ratio to sequential per round; A/A floor ±{floor:.3f}")
    for arm in ARMS:
        ratio = [a / b for a, b in zip(job[arm], job["sequential"])]
        verdict = "" if arm == "sequential" else f" ({against_floor(ratio, floor)})"
        print(f"  {arm:<24} {median_range(job[arm], '.2f')} s, ratio {median_range(ratio, '.3f')}{verdict}")


if __name__ == "__main__":
    main()
