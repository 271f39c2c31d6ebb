"""ETT% of the reference job at three checkpoint cadences, under the same injected failure rate.

    .venv/bin/python benchmarks/cadence.py [--steps 3000 --mtbf-s 30 --frequent 5 --rare 2000 --seeds 3]

The reference job (benchmarks/e2e_job.py, pack arm): the example TorchRec DLRM (26 tables x
20,000 x 16) on 2 CPU ranks under ``lightning run`` with ETTStrategy, ETTMonitor,
AsyncCheckpoint, CompileCache (warmed once before the timed jobs, so compilation is the same
small cost for every arm) and DynamicShapes. Failures are injected at a rate
(``LIGHTNING_ETT_FAULT_MTBF_S=MTBF:SEED``): in each attempt one rank is SIGKILLed after an
exponential time of training in that attempt; the draws depend only on the seed and the
attempt number, so every arm meets the same failures. Arms:

* **too frequent**: ``AsyncCheckpoint(every_n_train_steps=FREQUENT)``;
* **auto**: ``every_n_train_steps="auto"`` with ``mtbf_hours`` = the injected MTBF (the user-given
  failure rate; ``--mtbf-from-ledger`` lets it estimate the rate from the job's ledger instead);
* **too rare**: ``every_n_train_steps=RARE``.

Prints, per arm, the median over seeds of ETT%, wall, effective, lost and checkpoint_save
seconds and the number of attempts, each seed's ETT%, and the interval "auto" chose.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.reference_job import run_pack


def job(work: Path, every: str, steps: int, cache: Path, extra_env: dict[str, str], job_args: list[str],
        max_restarts: int) -> Path:
    return run_pack(work, ["--steps", str(steps), "--every", every, *job_args], cache, max_restarts, **extra_env)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--mtbf-s", type=float, default=30.0, help="injected mean time between failures (s of training)")
    p.add_argument("--frequent", type=int, default=5, help="the too-frequent fixed interval (steps)")
    p.add_argument("--rare", type=int, default=2000, help="the too-rare fixed interval (steps)")
    p.add_argument("--seeds", type=int, default=3, help="failure schedules (one job per arm each); medians over them")
    p.add_argument("--mtbf-from-ledger", action="store_true", help="auto estimates the MTBF from the job's ledger")
    p.add_argument("--max-restarts", type=int, default=30)
    args = p.parse_args()
    from lightning_ett.instrument.summary import summarize_run_dir
    from lightning_ett.instrument.timeline import CADENCE_FACT

    arms = {"too frequent": str(args.frequent), "auto": "auto", "too rare": str(args.rare)}
    results: dict[str, list] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cache = tmp / "compile_cache"
        job(tmp / "warm", "100", 50, cache, {}, [], 0)  # compile once: every arm starts from this cache
        for seed in range(1, args.seeds + 1):
            faults = {"LIGHTNING_ETT_FAULT_MTBF_S": f"{args.mtbf_s:g}:{seed}"}
            for name, every in arms.items():
                extra = [] if every != "auto" or args.mtbf_from_ledger else ["--mtbf-hours", repr(args.mtbf_s / 3600)]
                run_dir = job(tmp / f"{name.replace(' ', '_')}-{seed}", every, args.steps, cache, faults, extra,
                              args.max_restarts)
                results[name].append(summarize_run_dir(run_dir))

    def med(values: list[float]) -> float:
        return statistics.median(values)

    print(f"reference job: {args.steps} steps, injected MTBF {args.mtbf_s:g}s, {args.seeds} failure schedule(s); medians")
    print(f"{'':<24}" + "".join(f"{n:>16}" for n in arms))
    rows = {"ETT %": lambda s: s.ett_percent, "wall s": lambda s: s.wall_s, "effective s": lambda s: s.effective_s,
            "lost s": lambda s: s.lost_s, "checkpoint_save s": lambda s: s.phases.get("checkpoint_save", 0.0),
            "attempts": lambda s: float(len(s.attempts))}
    for label, get in rows.items():
        print(f"{label:<24}" + "".join(f"{med([get(s) for s in results[n]]):>16.2f}" for n in arms))
    chosen = [s.facts_named(CADENCE_FACT)[-1] for s in results["auto"] if s.facts_named(CADENCE_FACT)]
    if chosen:
        c = chosen[-1]
        print(f"auto chose every {c['interval_steps']} steps (~{c['interval_s']:.1f}s) from save cost {c['save_cost_s']:.3f}s "
              f"and MTBF {c['mtbf_s']:.0f}s [{c['mtbf_source']}]; "
              f"expected loss per failure {c['expected_loss_per_failure_s']:.1f}s")
    for name in arms:  # the spread: one unlucky failure schedule costs a too-rare cadence most
        print(f"ETT % per schedule, {name}: " + ", ".join(f"{s.ett_percent:.1f}" for s in results[name]))
    ett = {n: med([s.ett_percent for s in results[n]]) for n in arms}
    print(f"ETT%: too frequent {ett['too frequent']:.1f}  auto {ett['auto']:.1f}  too rare {ett['too rare']:.1f}")


if __name__ == "__main__":
    main()
