"""ETT% of the reference job at five checkpoint cadences, under the same injected failure rate.

    .venv/bin/python benchmarks/cadence.py [--steps 3000 --mtbf-s 30 --frequent 5 --round 100 --rare 2000 --seeds 5]

The reference job (benchmarks/e2e_job.py, pack arm): the example TorchRec DLRM (26 tables x
20,000 x 16) on 2 CPU ranks under ``lightning run`` with ETTStrategy, ETTMonitor,
AsyncCheckpoint, CompileCache (warmed once before the timed jobs, so compilation is the same
small cost for every arm) and DynamicShapes. Failures are injected at a rate
(``LIGHTNING_ETT_FAULT_MTBF_S=MTBF:SEED``): in each attempt one rank is SIGKILLed after an
exponential time of training in that attempt; the draws depend only on the seed and the
attempt number, so every arm draws the same failure times per attempt (an arm that trains
longer meets more of them). Arms:

* **too frequent**: ``AsyncCheckpoint(every_n_train_steps=FREQUENT)``;
* **Young/Daly once**: a fixed interval a careful user computes once, before the jobs:
  ``sqrt(2 · C · MTBF)`` from the save cost ``C`` and step time that a calibration run of this
  job measured (AsyncCheckpoint logs both) and the injected MTBF;
* **round**: a common round choice, ``every_n_train_steps=ROUND``;
* **auto**: ``every_n_train_steps="auto"``, learning the MTBF from the job's ledger as a real
  job would (a third of the job's age until the first failure; ``--mtbf-given`` hands it the
  injected MTBF);
* **too rare**: ``every_n_train_steps=RARE``;
* **Young/Daly A/A**: Young/Daly once again, the same interval: its distance from the first
  sizes the noise (the same failure schedule met at other moments of another job).

Every seed runs every arm, in ``round_order`` (a balanced Latin square).

Prints, per arm, the median over seeds of ETT%, wall, effective, lost and checkpoint_save
seconds and the number of attempts, every job's figures, and the interval "auto" chose; all of
it is printed again after every seed, so a run stopped early keeps what it measured. A job whose
launcher gave up (it used up ``--max-restarts``: a too-rare cadence against frequent failures
can) is reported as failed, with the ETT% its ledger had reached, and the other arms go on; the
medians then cover only the seeds where every arm finished (the same work in every arm), and
each arm's failures are counted. Any other failure of a job ends the run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.reference_job import run_pack
from benchmarks.spread import round_order
from lightning_ett.lifecycle.faults import FAULT_INJECTION

if TYPE_CHECKING:
    from lightning_ett.instrument.summary import Summary


def job(work: Path, every: str, steps: int, cache: Path, extra_env: dict[str, str], job_args: list[str],
        max_restarts: int) -> Path:
    return run_pack(work, ["--steps", str(steps), "--every", every, *job_args], cache, max_restarts, **extra_env)


@dataclass
class Outcome:
    """One arm's job for one failure schedule: its ledger's summary, and whether the job finished."""

    summary: Summary
    finished: bool


FIGURES = {"ETT %": lambda s: s.ett_percent, "wall s": lambda s: s.wall_s, "effective s": lambda s: s.effective_s,
           "lost s": lambda s: s.lost_s, "checkpoint_save s": lambda s: s.phases.get("checkpoint_save", 0.0),
           "attempts": lambda s: float(len(s.attempts))}


def print_table(results: dict[str, list[Outcome]], steps: int, mtbf_s: float) -> None:
    """Medians over the seeds where every arm finished, each arm's failures, then every job's figures."""
    from lightning_ett.instrument.timeline import CADENCE_FACT

    arms = list(results)
    seeds = len(next(iter(results.values())))
    complete = [i for i in range(seeds) if all(results[n][i].finished for n in arms)]
    print(f"reference job: {steps} steps, injected MTBF {mtbf_s:g}s; medians over the {len(complete)} of {seeds} "
          "failure schedule(s) where every arm finished")
    print(f"{'':<24}" + "".join(f"{n:>17}" for n in arms))
    for label, get in FIGURES.items():
        cells = [f"{statistics.median(get(results[n][i].summary) for i in complete):>17.2f}" if complete
                 else f"{'-':>17}" for n in arms]
        print(f"{label:<24}" + "".join(cells))
    print(f"{'failed jobs':<24}" + "".join(f"{sum(not o.finished for o in results[n]):>17}" for n in arms))
    for name in arms:  # every job: the spread, and what a failed job had reached
        for seed, o in enumerate(results[name], 1):
            figures = ", ".join(f"{label} {get(o.summary):.2f}" for label, get in FIGURES.items())
            print(f"  {name}, seed {seed}: {figures}" + ("" if o.finished else f"; FAILED: {o.summary.outcome}"))
    for seed, o in enumerate(results.get("auto", []), 1):
        chosen = o.summary.facts_named(CADENCE_FACT)
        if chosen:
            c = chosen[-1]
            print(f"auto, seed {seed}, last choice: every {c['interval_steps']} steps (~{c['interval_s']:.1f}s) from save cost "
                  f"{c['save_cost_s']:.3f}s and MTBF {c['mtbf_s']:.0f}s [{c['mtbf_source']}]")
    if "Young/Daly once" in results and "Young/Daly A/A" in results:
        gaps = [(seed, a.summary.ett_percent - b.summary.ett_percent)
                for seed, (a, b) in enumerate(zip(results["Young/Daly A/A"], results["Young/Daly once"]), 1)
                if a.finished and b.finished]
        if gaps:
            print("A/A: Young/Daly again minus Young/Daly, ETT points: "
                  + ", ".join(f"seed {seed} {g:+.1f}" for seed, g in gaps)
                  + f"; a difference between arms within ±{max(abs(g) for _, g in gaps):.1f} points is noise")
        else:
            print("A/A: no seed where both Young/Daly arms finished")
    sys.stdout.flush()


def gave_up(run_dir: Path, err: RuntimeError) -> Summary:
    """The summary of a job whose launcher used up its restarts on injected failures (a result of its cadence).

    Any other failure is re-raised: a traceback the launcher retried until it gave up, or one it does not retry,
    is the benchmark's error, not the cadence's, though its outcome also starts "gave up after".
    """
    from lightning_ett.instrument.summary import summarize_run_dir

    try:
        summary = summarize_run_dir(run_dir)
    except (FileNotFoundError, ValueError):
        raise err from None  # no ledger to read: the job failed before training, which is no cadence's doing
    outcome = summary.outcome or ""
    if not (outcome.startswith("gave up after") and FAULT_INJECTION in outcome):
        raise err
    return summary


def calibrate(tmp: Path, cache: Path, mtbf_s: float) -> tuple[int, float, float]:
    """Measure the save cost and step time once (60 steps, a save every 10); returns (Young/Daly steps, C, step s).

    This run also compiles once: every arm then starts from this compile cache.
    """
    from lightning_ett.instrument.summary import summarize_run_dir
    from lightning_ett.instrument.timeline import CADENCE_FACT

    facts = summarize_run_dir(job(tmp / "calibrate", "10", 60, cache, {}, [], 0)).facts_named(CADENCE_FACT)
    if not facts:
        raise RuntimeError("the calibration run logged no save cost (AsyncCheckpoint's cadence fact)")
    cost, step = float(facts[-1]["save_cost_s"]), float(facts[-1]["step_s"])
    return max(1, round(math.sqrt(2 * cost * mtbf_s) / step)), cost, step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--mtbf-s", type=float, default=30.0, help="injected mean time between failures (s of training)")
    p.add_argument("--frequent", type=int, default=5, help="the too-frequent fixed interval (steps)")
    p.add_argument("--round", type=int, default=100, help="the common round fixed interval (steps)")
    p.add_argument("--rare", type=int, default=2000, help="the too-rare fixed interval (steps)")
    p.add_argument("--seeds", type=int, default=5, help="failure schedules (one job per arm each); medians over them")
    p.add_argument("--mtbf-given", action="store_true", help="hand auto the injected MTBF instead of its ledger's estimate")
    p.add_argument("--arms", nargs="+", default=None, help="run only these arms (names as printed, e.g. auto)")
    p.add_argument("--max-restarts", type=int, default=30)
    args = p.parse_args()
    from lightning_ett.instrument.summary import summarize_run_dir

    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as d:
        tmp = Path(d)
        cache = tmp / "compile_cache"
        young_daly, cost, step = calibrate(tmp, cache, args.mtbf_s)
        print(f"calibration: save cost {cost:.3f} s, step {step * 1000:.1f} ms -> Young/Daly once: every {young_daly} steps",
              flush=True)
        arms = {"too frequent": str(args.frequent), "Young/Daly once": str(young_daly), "round": str(args.round),
                "auto": "auto", "too rare": str(args.rare), "Young/Daly A/A": str(young_daly)}
        if args.arms:
            unknown = set(args.arms) - set(arms)
            if unknown:
                p.error(f"--arms: unknown {sorted(unknown)}; choose from {list(arms)}")
            arms = {name: every for name, every in arms.items() if name in args.arms}
        results: dict[str, list[Outcome]] = {name: [] for name in arms}
        for seed in range(1, args.seeds + 1):
            faults = {"LIGHTNING_ETT_FAULT_MTBF_S": f"{args.mtbf_s:g}:{seed}"}
            for name, every in round_order(list(arms.items()), seed - 1):
                extra = [] if every != "auto" or not args.mtbf_given else ["--mtbf-hours", repr(args.mtbf_s / 3600)]
                work = tmp / f"{name.replace(' ', '_').replace('/', '_')}-{seed}"
                try:
                    summary = summarize_run_dir(job(work, every, args.steps, cache, faults, extra, args.max_restarts))
                    finished = True
                except RuntimeError as err:
                    summary, finished = gave_up(work / "run", err), False
                results[name].append(Outcome(summary, finished))
                print(f"seed {seed} {name}: ETT {summary.ett_percent:.1f} %"
                      + ("" if finished else f" (not finished: {summary.outcome})"), flush=True)
            print_table(results, args.steps, args.mtbf_s)


if __name__ == "__main__":
    main()
