"""End-to-end ETT% of the reference job: the pack vs vanilla Lightning, one injected SIGKILL each.

    .venv/bin/python benchmarks/e2e_ett.py [--steps 600 --every 100 --kill-at 350] [--rounds 1]

The reference job (benchmarks/e2e_job.py): the example TorchRec DLRM (26 tables x 20,000 x 16)
on 2 CPU ranks (gloo), batch 512, ``--steps`` optimizer steps, a checkpoint every ``--every``
steps, the dense parts compiled with torch.compile. Rank 1 is SIGKILLed after step
``--kill-at`` of the first attempt (``LIGHTNING_ETT_FAULT_KILL``) and the job is restarted once.
Every attempt starts with an empty default inductor directory: a restart on another host
(the pack's CompileCache directory stands for shared storage and carries over).

* **vanilla**: stock Lightning (DDP, synchronous ``ModelCheckpoint(save_last=True)``), cold
  compile on every attempt, restarted at once by this script from ``last.ckpt`` (torchrun cannot
  restart it on this torch, see the README; the restart gap here is zero, which flatters it).
  Its clock runs from this script's first launch to its last process's exit, as the pack's
  launcher's does.
* **pack, first job**: ``lightning run --max-restarts 1`` + ETTStrategy + ETTMonitor +
  AsyncCheckpoint + CompileCache + DynamicShapes, with an empty compile cache.
* **pack, recurring job**: the same, with the compile cache a previous job of this model left
  (what a retraining pipeline has from its second run on).

Both arms are measured by the same ETTMonitor ledger (wall time from launch to the end, across
attempts). Prints ETT%, the phase breakdown of each, and overhead ÷ vanilla overhead.
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
from benchmarks.reference_job import JOB, env, run, run_pack
from lightning_ett.instrument.ledger import LedgerWriter, launcher_ledger_path


def vanilla(work: Path, job: list[str], kill: str) -> Path:
    """Two plain launches; this script plays the operator who restarts the job (at once)."""
    started = repr(time.time())  # the job's clock starts when it is launched, as the pack's launcher's does
    run([sys.executable, JOB, "--arm", "vanilla", "--work", str(work), *job],
        env(work / "inductor0", LIGHTNING_ETT_FAULT_KILL=kill, LIGHTNING_ETT_JOB_START=started), expect_ok=False)
    run([sys.executable, JOB, "--arm", "vanilla", "--work", str(work), *job, "--resume"],
        env(work / "inductor1", LIGHTNING_ETT_JOB_START=started))
    # ... and ends when its last process has exited, as under the pack's launcher.
    writer = LedgerWriter(launcher_ledger_path(work / "run", 0))
    writer.append({"kind": "end", "time": time.time(), "exitcode": 0, "reason": "finished"})
    writer.close()
    return work / "run"


def pack(work: Path, job: list[str], kill: str, compile_cache: Path) -> Path:
    return run_pack(work, job, compile_cache, max_restarts=1, LIGHTNING_ETT_FAULT_KILL=kill)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--kill-at", type=int, default=350)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    from lightning_ett.instrument.summary import summarize_run_dir
    from lightning_ett.instrument.timeline import PHASE_NAMES

    job = ["--steps", str(args.steps), "--every", str(args.every)]
    kill = f"1:{args.kill_at}:0"
    arms: dict[str, list] = {"vanilla": [], "pack, first job": [], "pack, recurring job": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in range(args.rounds):
            arms["vanilla"].append(summarize_run_dir(vanilla(tmp / f"v{r}", job, kill)))
            cache = tmp / f"compile_cache{r}"
            arms["pack, first job"].append(summarize_run_dir(pack(tmp / f"p{r}", job, kill, cache)))
            # The cache the job above left is what the next job of this model starts with.
            arms["pack, recurring job"].append(summarize_run_dir(pack(tmp / f"q{r}", job, kill, cache)))

    def med(values: list[float]) -> float:
        return statistics.median(values)

    names = list(arms)
    print(f"{'seconds (mean over ranks)':<26}" + "".join(f"{n:>22}" for n in names))
    for phase in PHASE_NAMES:
        values = [med([s.phases.get(phase, 0.0) for s in arms[n]]) for n in names]
        if max(values) >= 0.005:
            print(f"{phase:<26}" + "".join(f"{v:>22.2f}" for v in values))
    overhead = {n: med([s.wall_s - s.effective_s for s in arms[n]]) for n in names}
    rows = {"wall": lambda s: s.wall_s, "effective (train)": lambda s: s.effective_s,
            "overhead": lambda s: s.wall_s - s.effective_s, "ETT %": lambda s: s.ett_percent,
            "attempts": lambda s: len(s.attempts)}
    print("-" * (26 + 22 * len(names)))
    for label, fn in rows.items():
        print(f"{label:<26}" + "".join(f"{med([fn(s) for s in arms[n]]):>22.2f}" for n in names))
    ratios = [overhead[n] / overhead["vanilla"] for n in names]
    print(f"{'overhead / vanilla':<26}" + "".join(f"{r:>22.3f}" for r in ratios))
    print(f"(medians of {args.rounds} round(s); goal: overhead / vanilla <= 0.25)")


if __name__ == "__main__":
    main()
