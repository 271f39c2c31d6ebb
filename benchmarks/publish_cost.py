"""What ModelPublisher costs the training loop: the reference job with and without it, side by side.

    .venv/bin/python benchmarks/publish_cost.py [--steps 1000 --every 100 --rounds 3]

The reference job (benchmarks/e2e_job.py, pack arm, no failures): the example TorchRec DLRM
(26 tables x 20,000 x 16; 8.4 M parameters, a 33.5 MB artifact) on 2 CPU ranks under
``lightning run``, AsyncCheckpoint every ``--every`` steps, with the compile cache warmed once.
The "publisher" arm adds ``ModelPublisher(submodule="model", metrics=["loss"])``: every
checkpoint becomes a version, exported by its own process while training goes on.

A third arm, "baseline A/A", is the baseline again: its ratio to the baseline sizes the noise.
Prints per arm the medians over rounds (arms in ``round_order``: a balanced Latin
square) of the training time (the ``train``
phase: ``--steps`` steps' compute, which a background export on the same 2 cores slows), the
``publish`` phase (what the trainer spent: notifications and the wait for the last version),
the versions published, and the ratios publisher ÷ baseline.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.reference_job import run_pack
from benchmarks.spread import median_range, round_order


def job(work: Path, cache: Path, steps: int, every: int, publish: bool) -> Path:
    args = ["--steps", str(steps), "--every", str(every), *(["--publish"] if publish else [])]
    return run_pack(work, args, cache, max_restarts=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from lightning_ett.instrument.summary import summarize_run_dir
    from lightning_ett.instrument.timeline import PUBLISH_FACT

    arms = {"baseline": False, "publisher": True, "baseline A/A": False}
    results: dict[str, list] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cache = tmp / "compile_cache"
        job(tmp / "warm", cache, 2 * args.every, args.every, True)  # untimed: compiles, saves and publishes once
        for r in range(args.rounds):
            for name, publish in round_order(list(arms.items()), r):
                run_dir = job(tmp / f"{name.replace(' ', '_').replace('/', '_')}-{r}", cache, args.steps, args.every, publish)
                results[name].append(summarize_run_dir(run_dir))
                print(f"round {r} {name}: wall {results[name][-1].wall_s:.2f} s, ETT {results[name][-1].ett_percent:.2f} %",
                      flush=True)

    rows = {"train s": lambda s: s.effective_s, "publish s": lambda s: s.phases.get("publish", 0.0),
            "checkpoint_save s": lambda s: s.phases.get("checkpoint_save", 0.0), "wall s": lambda s: s.wall_s,
            "ETT %": lambda s: s.ett_percent, "versions": lambda s: float(len(s.facts_named(PUBLISH_FACT)))}
    print(f"reference job: {args.steps} steps, a checkpoint every {args.every}; medians (min-max) of {args.rounds} rounds")
    print(f"{'':<20}{'baseline':>20}{'publisher':>20}{'baseline A/A':>20}{'publisher / base':>22}{'A/A / base':>22}")
    for label, get in rows.items():
        values = {name: [get(s) for s in results[name]] for name in arms}
        cells = "".join(f"{median_range(values[name]):>20}" for name in arms)
        if label != "versions" and all(v > 0 for v in values["baseline"]):  # per-round ratios, then their median
            cells += "".join(f"{median_range([x / b for x, b in zip(values[name], values['baseline'])], '.3f'):>22}"
                             for name in ("publisher", "baseline A/A"))
        print(f"{label:<20}{cells}")


if __name__ == "__main__":
    main()
