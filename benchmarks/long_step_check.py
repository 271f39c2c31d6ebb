"""Does the pack slow the long job's steps? The user job without failures, identical steps, five arms.

    .venv/bin/python benchmarks/long_step_check.py STEPS ROUNDS WORK_DIR

``e2e_ett.py --job long`` scores ETT% with each arm's own ``train`` seconds, so a pack whose steps were
slower would look better than it is. Here each arm trains STEPS steps of the user job (e2e_user_job.py)
with no failure injected: same-training under torchrun, the same again (A/A: the noise floor), the same
under ``lightning run`` (the launcher alone), the pack saving every 276 steps and the pack with ``"auto"``
(MTBF 150 s). The arms' order is a row of a Williams design per round (``spread.round_order``).
Printed: every run's ``train`` seconds and milliseconds per step from the ledger, then per arm the
median (min-max) ms per step and its per-round ratio to same-training under torchrun, against the A/A floor.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.e2e_ett import USER_JOB, Job, run_lightning, run_torchrun
from benchmarks.spread import aa_floor, against_floor, median_range, round_order
from lightning_ett.instrument.summary import Summary

BASE, AA = "same/torchrun", "same/torchrun A/A"


def main() -> None:
    steps, rounds, tmp = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    data = ["--steps", str(steps), "--batches-per-epoch", "1000"]
    fixed = Job(USER_JOB, [*data, "--every", "276"], "", 0)
    auto = Job(USER_JOB, [*data, "--every", "auto", "--mtbf-hours", repr(150 / 3600)], "", 0)

    def inductor(d: Path) -> Path:
        return d.parent / (d.name + "-inductor")

    arms = {BASE: lambda d: run_torchrun(d, fixed, "same", inductor(d)).summary,
            AA: lambda d: run_torchrun(d, fixed, "same", inductor(d)).summary,
            "same/lightning run": lambda d: run_lightning(d, fixed, inductor(d), arm="same").summary,
            "pack every 276": lambda d: run_lightning(d, fixed, inductor(d)).summary,
            "pack auto": lambda d: run_lightning(d, auto, inductor(d)).summary}
    ms: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        for name in round_order(list(arms), r):
            s: Summary = arms[name](tmp / f"r{r}" / name.replace("/", "_").replace(" ", "_"))
            ms[name].append(1e3 * s.effective_s / steps)
            print(f"round {r} {name:20s} train {s.effective_s:.2f}s  {ms[name][-1]:.2f} ms/step  "
                  f"save {s.phases.get('checkpoint_save', 0.0):.2f}s wall {s.wall_s:.1f}s", flush=True)
    floor = aa_floor([a / b for a, b in zip(ms[AA], ms[BASE])])
    print(f"ms per step, medians (min-max) of {rounds} round(s); ratio to {BASE} per round; A/A floor +-{floor:.3f}")
    for name, values in ms.items():
        ratio = [v / b for v, b in zip(values, ms[BASE])]
        verdict = "" if name == BASE else f"  -> {against_floor(ratio, floor)}"
        print(f"  {name:20s} {median_range(values)} ms/step   / {BASE}: {median_range(ratio, '.3f')}{verdict}")


if __name__ == "__main__":
    main()
