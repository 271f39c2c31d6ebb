"""Work lost to one failure under ``every_n_train_steps="auto"``: incremental saves against full saves (#34).

    .venv/bin/python benchmarks/incremental_auto.py [--rounds 3 --steps 600 --num-embeddings 1000000]

The reference job (benchmarks/e2e_job.py, pack arm, as cadence.py runs it: ETTStrategy table-wise
with fused row-wise AdaGrad, ETTMonitor, AsyncCheckpoint keeping the last checkpoint, CompileCache
warmed once, DynamicShapes) with changes that give a delta something to skip: tables of
``--num-embeddings`` rows (26 x 1M x 16 by default, 1.8 GB with their AdaGrad state: on the
reference job's 20,000-row tables the chain policy makes every save full) and a non-repeating id
stream (``--fresh-batches``; the data module otherwise cycles 10 batches, which would flatter
deltas): Zipf of exponent 1.05 as in incremental_checkpoint.py (``--zipf``), or uniform, the worst
case for deltas (``--zipf 0``). Arms, identical but for one flag:

* **auto, full**: ``AsyncCheckpoint(every_n_train_steps="auto")``;
* **auto, incremental**: the same with ``incremental=True``;
* **auto, full A/A**: the first arm again; its distance from the first sizes the noise.

Each round kills rank 1 once (``LIGHTNING_ETT_FAULT_KILL``) right after a step drawn from the round's
seed in the middle half of the job, the same step for every arm; ``lightning run`` restarts the job,
which resumes from its newest checkpoint. Arms alternate (``round_order``). The goal's metric is
the work lost: ETTMonitor's ``lost`` seconds (steps trained again after the restart). Also printed:
ETT%, checkpoint seconds, the interval "auto" chose last and the save cost it measured.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.reference_job import run_pack
from benchmarks.spread import round_order

ARMS = {"auto, full": [], "auto, incremental": ["--incremental"], "auto, full A/A": []}


def kill_step(steps: int, seed: int) -> int:
    """The round's failure: right after a step in the job's middle half (after "auto" has measured its saves)."""
    return random.Random(seed).randint(steps // 4 + 1, 3 * steps // 4)


def run_arm(work: Path, cache: Path, steps: int, flags: list[str], kill: int | None) -> dict:
    from lightning_ett.instrument.summary import summarize_run_dir
    from lightning_ett.instrument.timeline import CADENCE_FACT, CHECKPOINT_FACT

    env = {"LIGHTNING_ETT_FAULT_KILL": f"1:{kill}"} if kill is not None else {}
    run_dir = run_pack(work, ["--steps", str(steps), "--every", "auto", *flags], cache, 1 if kill else 0, **env)
    s = summarize_run_dir(run_dir)
    cadence = s.facts_named(CADENCE_FACT)
    last = cadence[-1] if cadence else {}
    saves = s.facts_named(CHECKPOINT_FACT)
    said = [line for log in sorted((run_dir / "worker_logs").rglob("*.log"))
            for line in log.read_text(errors="replace").splitlines() if "deltas pay only under" in line]
    return {"lost_s": s.lost_s, "ett_percent": s.ett_percent, "wall_s": s.wall_s, "effective_s": s.effective_s,
            "checkpoint_save_s": s.phases.get("checkpoint_save", 0.0),
            "checkpoint_load_s": s.phases.get("checkpoint_load", 0.0), "attempts": len(s.attempts),
            "interval_steps": last.get("interval_steps"), "save_cost_s": last.get("save_cost_s"),
            "deltas": sum(bool(f.get("incremental")) for f in saves), "saves": len(saves),
            "full_by_cost": len(said),  # times the cost rule (save_kind) turned deltas off
            "choices": [(c.get("interval_steps"), round(float(c.get("save_cost_s", 0)), 3)) for c in cadence]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--num-embeddings", type=int, default=1_000_000)
    p.add_argument("--zipf", type=float, default=1.05, help="the id stream's Zipf exponent; 0: uniform ids")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="write every run's figures here")
    args = p.parse_args()
    job_args = ["--num-embeddings", str(args.num_embeddings), "--fresh-batches",
                *(["--zipf", str(args.zipf)] if args.zipf > 0 else [])]
    stream = f"Zipf {args.zipf:g}" if args.zipf > 0 else "uniform"
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        tmp = Path(d)
        cache = tmp / "compile_cache"
        run_arm(tmp / "warm", cache, 40, job_args, None)  # compiles once; every arm then starts from this cache
        results: dict[str, list[dict]] = {name: [] for name in ARMS}
        for r in range(args.rounds):
            kill = kill_step(args.steps, r + 1)
            for name, flags in round_order(list(ARMS.items()), r):
                work = tmp / f"{name.replace(', ', '_').replace(' ', '_').replace('/', '')}-{r}"
                res = run_arm(work, cache, args.steps, [*job_args, *flags], kill)
                res["kill_step"] = kill
                results[name].append(res)
                print(f"round {r + 1} (kill after step {kill}) {name}: lost {res['lost_s']:.2f} s, ETT "
                      f"{res['ett_percent']:.1f} %, checkpoint_save {res['checkpoint_save_s']:.2f} s, {res['deltas']} deltas of "
                      f"{res['saves']} saves (deltas turned off by cost {res['full_by_cost']}x), auto's last "
                      f"choice every {res['interval_steps']} steps from a save cost of {res['save_cost_s']} s; "
                      f"choices {res['choices']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"reference job, {args.steps} steps, tables of {args.num_embeddings} rows, fresh {stream} ids, one kill per "
          f"round; median (min-max) over {args.rounds} rounds")
    for key in ("lost_s", "ett_percent", "checkpoint_save_s", "checkpoint_load_s", "interval_steps", "save_cost_s"):
        cells = []
        for name in ARMS:
            values = [float(r[key]) for r in results[name] if r[key] is not None]
            cells.append(f"{name}: {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
                         if values else f"{name}: -")
        print(f"{key:<18} " + " | ".join(cells))


if __name__ == "__main__":
    main()
