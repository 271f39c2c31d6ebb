"""FP8Probe: what it costs the training loop, what it finds, and what training in FP8 on its choice gives.

    .venv/bin/python benchmarks/fp8_probe.py [--rounds 3] [--models planted dlrm]

For each model — the planted-outlier MLP (examples/fp8_outliers.py) and the example DLRM (one
process) — every round is one process (tests/scripts/fp8_job.py ``probe --baseline``) that trains
the model twice on the same data, without and with ``FP8Probe()`` at its defaults, the order
alternating from round to round; the figure is the training loop's time with ÷ without
(medians, min–max; goal <= 1.02), beside the probe's own measured share. Then the verdicts of
the last round, and three trainings with FP8 emulated (``emulate_float8_training``: the casts
and GEMMs the probe measures with) on no layer, on the probe's safe layers, and on all layers,
each scored by its loss on 16 unseen batches.
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
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from spread import median_range

JOB = REPO / "tests" / "scripts" / "fp8_job.py"
STEPS = {"planted": 3000, "dlrm": 1500}  # probe rounds: enough for the default 2 % budget to reach verdicts
TRAIN_STEPS = {"planted": 600, "dlrm": 300}


def job(*args: str) -> dict:
    out = Path(args[args.index("--out") + 1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env.update(PYTHONPATH=str(REPO), WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, str(JOB), *args], env=env, capture_output=True, text=True, timeout=3600,
                          check=False, cwd=str(out))
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads((out / "result.json").read_text())


def sampled_steps_extra(step_s: list[float], sampled: list[int]) -> float:
    """What the sampled steps took beyond a typical (median) unsampled step, as a share of the rest of the loop.

    Read from one run's own step clock, so slow drifts of the machine (which move whole runs by
    10-20 % here) cancel out; it misses only costs spread over every step (the probe's per-step
    check is two comparisons).
    """
    marked = set(sampled)
    typical = statistics.median(s for i, s in enumerate(step_s) if i not in marked)
    extra = sum(max(step_s[i] - typical, 0.0) for i in marked if i < len(step_s))
    return extra / (sum(step_s) - extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", choices=sorted(STEPS), default=["planted", "dlrm"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ett-fp8-") as tmp:
        for model in args.models:
            ratios, overheads, sampled_shares, hook_us, last = [], [], [], [], {}
            for r in range(args.rounds):
                out = Path(tmp) / f"{model}-{r}"
                out.mkdir()
                order = ["--probe-first"] if r % 2 else []
                last = job("probe", "--baseline", *order, "--model", model, "--steps", str(STEPS[model]), "--out", str(out))
                ratios.append(last["loop_s_with"] / last["loop_s_without"])
                overheads.append(100 * last["overhead"])
                sampled_shares.append(100 * sampled_steps_extra(last["step_s_with"], last["sampled_steps"]))
                unsampled = [h for i, h in enumerate(last["hook_s"]) if i not in set(last["sampled_steps"])]
                hook_us.append(1e6 * statistics.median(unsampled))  # (a mean would add GC pauses that land in them)
                print(f"{model} round {r + 1}: with/without {ratios[-1]:.3f} (loops {last['loop_s_with']:.2f} / "
                      f"{last['loop_s_without']:.2f} s; the probe's own share {overheads[-1]:.2f} %, "
                      f"{last['samples_taken']} samples; the sampled steps' extra time {sampled_shares[-1]:.2f} %; "
                      f"its hooks on an unsampled step, median {hook_us[-1]:.1f} us)", flush=True)
            print(f"\n## {model}: {STEPS[model]} steps per loop, {args.rounds} rounds\n")
            print(f"step time with FP8Probe / without: **{median_range(ratios, '.3f')}** (goal <= 1.02: "
                  f"{'met' if statistics.median(ratios) <= 1.02 else 'NOT met'}); the probe's own measured share "
                  f"{median_range(overheads, '.2f')} %; the sampled steps' extra wall time over a typical step, as a "
                  f"share of the loop: {median_range(sampled_shares, '.2f')} %; its hooks on an unsampled step, timed in "
                  f"place (median): {median_range(hook_us, '.1f')} us\n")
            print("| layer | verdict | eligible | SQNR dB, worst GEMM (95 % interval) | samples | M×K×N | FLOP share |")
            print("|---|---|---|---|---|---|---|")
            for fqn, res in last["results"].items():
                low, high = res["sqnr_db_low"], res["sqnr_db_high"]
                interval = f"{res['sqnr_db_mean']:.1f} ({low:.1f} – {high:.1f})" if low is not None else \
                    f"{res['sqnr_db_mean']:.1f}"
                shape = res["shape"]
                print(f"| {fqn} | {res['verdict']} | {'yes' if res['eligible'] else 'no'} | {interval} | {res['samples']} | "
                      f"{shape['M']}×{shape['K']}×{shape['N']} | {100 * res['flop_share']:.1f} % |")
            print(f"\n{last['summary_line']}")
            results_file = Path(tmp) / f"{model}-{args.rounds - 1}" / "result.json"
            train_out = Path(tmp) / f"{model}-train"
            train_out.mkdir()
            trained = job("train", "--model", model, "--results", str(results_file), "--steps", str(TRAIN_STEPS[model]),
                          "--out", str(train_out))
            base = trained["none"]["held_out_loss"]
            print(f"\nEmulated FP8 training, {TRAIN_STEPS[model]} steps, held-out loss (÷ full precision):")
            for arm, label in (("none", "no layer (full precision)"), ("safe", "the probe's safe layers"),
                               ("all", "every Linear")):
                loss = trained[arm]["held_out_loss"]
                print(f"- FP8 on {label}: {loss:.6f} ({loss / base:.4f}); layers: {trained[arm]['swapped']}")
            print()


if __name__ == "__main__":
    main()
