"""FP8Probe: what it costs the training loop, what it finds, and whether its verdict flips where FP8 starts to hurt.

    .venv/bin/python benchmarks/fp8_probe.py [--rounds 3] [--steps 3000] [--precision bf16-mixed] [--batch-size 256]
                                             [--sweep 10 100 1000 10000 100000] [--seeds 0 1 2] [--skip-overhead]

(``--sweep`` with no scale: no sweep. ``--batch-size``: the overhead arms' batches; 1024 makes steps of ~10 ms.)

**Overhead** (the goal's own metric: the training loop with the probe ÷ without, goal <= 1.02). The
planted-outlier MLP (examples/fp8_outliers.py), ``--steps`` steps under ``--precision``. Every
round is one process (tests/scripts/fp8_job.py ``probe --arms ...``) that trains the same model on
the same data four times: an untimed warm-up fit, then without the probe (A), without it again (A',
the A/A control that sizes the noise), and with ``FP8Probe()`` at its defaults, in ``round_order``.
The figure is each round's loop time with ÷ A, beside A' ÷ A; medians (min-max) and every run.

**The outlier sweep.** The planted layer's four useless input features at scale 10 ... 1e5, with
several data seeds. For each: the probe's verdict on the planted layer (a probed fit of
``--steps``), and the held-out loss of training with torchao's own ``Float8Linear`` on the planted
layer alone ÷ training without FP8 (same precision, seed, data, 600 steps). The verdict should turn
``unsafe`` where that ratio starts to rise.
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
from spread import median_range, round_order

JOB = REPO / "tests" / "scripts" / "fp8_job.py"
ARMS = ["none", "none", "probe"]
LABELS = ("A", "A'", "with")  # ARMS' names: without, without again (A/A), with the probe


def job(*args: str) -> dict:
    out = Path(args[args.index("--out") + 1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env.update(PYTHONPATH=str(REPO), WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, str(JOB), *args], env=env, capture_output=True, text=True, timeout=3600,
                          check=False, cwd=str(out))
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads((out / "result.json").read_text())


def overhead(tmp: Path, rounds: int, steps: int, precision: str, batch_size: int) -> dict:
    with_ratio, aa_ratio, last = [], [], {}
    for r in range(rounds):
        # A first fit in a process pays one-off costs (allocator, kernels' first calls): an untimed one goes first,
        # then the arms in a balanced Latin square, each labelled by its own place in ARMS (not by order of appearance).
        labels = ["warm-up", *round_order(list(LABELS), r)]
        order = [ARMS[LABELS.index(label)] if label in LABELS else "none" for label in labels]
        out = tmp / f"overhead-{r}"
        out.mkdir()
        last = job("probe", "--arms", ",".join(order), "--steps", str(steps), "--precision", precision,
                   "--batch-size", str(batch_size), "--out", str(out))
        loops = dict(zip(labels, last["loop_s"]))
        with_ratio.append(loops["with"] / loops["A"])
        aa_ratio.append(loops["A'"] / loops["A"])
        print(f"round {r + 1} ({' '.join(labels)}): loops " + ", ".join(f"{k} {v:.2f}s" for k, v in loops.items())
              + f"; with/A {with_ratio[-1]:.3f}, A'/A {aa_ratio[-1]:.3f}; the probe's own share "
              f"{100 * last['overhead']:.2f} %, {last['samples_taken']} samples", flush=True)
    step_ms = 1e3 * statistics.median(last["step_s_with"])
    print(f"\n## overhead: planted model, batch {batch_size}, {steps} steps (~{step_ms:.1f} ms each), {precision}, "
          f"{rounds} rounds\n")
    print(f"training loop with FP8Probe ÷ without: **{median_range(with_ratio, '.3f')}** {[round(x, 3) for x in with_ratio]}"
          f" (goal <= 1.02: {'met' if statistics.median(with_ratio) <= 1.02 else 'NOT met'})")
    print(f"A/A control (without ÷ without): {median_range(aa_ratio, '.3f')} {[round(x, 3) for x in aa_ratio]}\n")
    print("| layer | verdict | eligible | windows (needed) | bad | SQNR dB q10 / worst | measured GEMMs | reason |")
    print("|---|---|---|---|---|---|---|---|")
    for fqn, res in last["results"].items():
        q10, worst = res["sqnr_db_q10"], res["sqnr_db_worst"]
        print(f"| {fqn} | {res['verdict']} | {'yes' if res['eligible'] else 'no'} | {res['samples']} "
              f"({res['samples_needed'] or '-'}) | {res['bad_windows']} | {q10 if q10 is None else round(q10, 1)} / "
              f"{worst if worst is None else round(worst, 1)} | {'+'.join(res['measured_gemms'])} | {res['reason']} |")
    print(f"\n{last['summary_line']}\n")
    return last


def sweep(tmp: Path, scales: list[float], seeds: list[int], steps: int, precision: str) -> None:
    print(f"## outlier sweep: {precision}, probe {steps} steps; torchao FP8 on the planted layer alone, 600 steps\n")
    print("| outlier scale | seed | planted verdict (bad / windows) | planted worst SQNR dB | loss FP8 ÷ bf16 |")
    print("|---|---|---|---|---|")
    for scale in scales:
        for seed in seeds:
            common = ["--outlier-scale", f"{scale:g}", "--seed", str(seed), "--precision", precision]
            out = tmp / f"sweep-{scale:g}-{seed}"
            out.mkdir()
            probed = job("probe", "--steps", str(steps), "--probe-args", json.dumps({"include": ["planted"]}),
                         "--out", str(out), *common)
            planted = probed["results"]["planted"]
            trained_out = tmp / f"sweep-{scale:g}-{seed}-train"
            trained_out.mkdir()
            trained = job("train", "--train-arms", "none,planted", "--steps", "600", "--out", str(trained_out), *common)
            ratio = trained["planted"]["held_out_loss"] / trained["none"]["held_out_loss"]
            worst = planted["sqnr_db_worst"]
            print(f"| {scale:g} | {seed} | {planted['verdict']} ({planted['bad_windows']} / {planted['samples']}) | "
                  f"{worst if worst is None else round(worst, 1)} | {ratio:.4f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--sweep", type=float, nargs="*", default=[10, 100, 1000, 10000, 100000])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sweep-steps", type=int, default=1500)
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ett-fp8-") as tmp:
        if not args.skip_overhead:
            overhead(Path(tmp), args.rounds, args.steps, args.precision, args.batch_size)
        if args.sweep:
            sweep(Path(tmp), args.sweep, args.seeds, args.sweep_steps, args.precision)


if __name__ == "__main__":
    main()
