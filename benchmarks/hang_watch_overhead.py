"""What the hang watch costs a healthy job: total time ÷ steps, with and without it, under ``lightning run``.

    .venv/bin/python benchmarks/hang_watch_overhead.py [--rounds 3] [--steps 1500]

The user job (e2e_user_job.py, pack arm: ETTStrategy, ETTMonitor, AsyncCheckpoint every 100
steps keeping one, an offline WandbLogger) on 2 ranks under ``lightning run --max-restarts 0``,
no failure. Arms (identical work; only the watch differs):

* **watch**: ``lightning run``'s defaults (the hang watch on: the launcher reads ledger tails
  and ``/proc``; each worker keeps an idle thread on a named pipe);
* **no watch**: ``--no-hang-watch``;
* **no watch A/A**: the same again, the noise floor.

Per run: the probe's wall (launcher start to exit) ÷ steps — everything the watch could slow,
start-up and shutdown included — and the ledger's ``train`` ÷ steps (the step time). Each round
runs the three arms in rotated order. Headline: watch ÷ no watch of wall ÷ steps, per round;
goal <= 1.01, and a difference inside the A/A floor is reported as none.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.e2e_ett import USER_JOB, failed, launch
from benchmarks.reference_job import BIN, env
from benchmarks.spread import aa_floor, against_floor, median_range, round_order
from lightning_ett.instrument.summary import summarize_run_dir

GOAL = 1.01
ARMS = ("watch", "no watch", "no watch A/A")


def run(work: Path, steps: int, watch: bool) -> dict[str, float]:
    work.mkdir(parents=True)
    cmd = [str(BIN / "lightning"), "run", "--devices", "2", "--max-restarts", "0", "--run-dir", str(work / "run"),
           *([] if watch else ["--no-hang-watch"]), USER_JOB, "--arm", "pack", "--work", str(work), "--steps", str(steps),
           "--every", "100", "--batches-per-epoch", "1000"]
    started = time.time()
    rc = launch(cmd, env(work / "inductor"), work / "launcher.log")
    probe = time.time() - started
    if rc != 0:
        raise failed(f"lightning run {'with' if watch else 'without'} the hang watch", work / "launcher.log", rc)
    summary = summarize_run_dir(work / "run")
    return {"wall_per_step_ms": 1000 * probe / steps, "train_per_step_ms": 1000 * summary.effective_s / steps,
            "ledger_wall_s": summary.wall_s, "probe_s": probe}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=1500)
    args = p.parse_args()
    runs: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}
    with tempfile.TemporaryDirectory(prefix="ett-watch-") as tmp:
        for r in range(args.rounds):
            order = round_order(ARMS, r)
            for arm in order:
                runs[arm].append(run(Path(tmp) / f"r{r}-{arm.replace(' ', '-').replace('/', '')}", args.steps,
                                     watch=arm == "watch"))
            walls = ", ".join(f"{a} {runs[a][-1]['wall_per_step_ms']:.2f} ms" for a in order)
            print(f"round {r + 1}: wall ÷ steps {walls}", flush=True)
    print(f"\n{args.rounds} rounds x {args.steps} steps, medians (min–max):")
    for arm in ARMS:
        print(f"  {arm:<14} wall ÷ steps {median_range([x['wall_per_step_ms'] for x in runs[arm]], '.2f')} ms, "
              f"train ÷ steps {median_range([x['train_per_step_ms'] for x in runs[arm]], '.2f')} ms, "
              f"wall {median_range([x['probe_s'] for x in runs[arm]], '.1f')} s")
    ratio = [w["wall_per_step_ms"] / n["wall_per_step_ms"] for w, n in zip(runs["watch"], runs["no watch"])]
    aa = [a["wall_per_step_ms"] / n["wall_per_step_ms"] for a, n in zip(runs["no watch A/A"], runs["no watch"])]
    floor = aa_floor(aa)
    median = statistics.median(ratio)
    verdict = against_floor(ratio, floor)
    print(f"watch / no watch, wall ÷ steps, per round: {median_range(ratio, '.3f')} (goal <= {GOAL}); "
          f"A/A {median_range(aa, '.3f')} (floor ±{floor:.3f}): {verdict}; "
          f"goal {'met' if median <= GOAL else 'not shown (inside the floor)' if verdict.startswith('no') else 'NOT met'}")
    print("every run, wall ÷ steps (ms): " + "; ".join(
        f"{a} " + "/".join(f"{x['wall_per_step_ms']:.2f}" for x in runs[a]) for a in ARMS))


if __name__ == "__main__":
    main()
