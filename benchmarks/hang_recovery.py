"""What a hang costs: ``lightning run``'s hang watch vs stock Lightning under torchrun, on the example DLRM.

    .venv/bin/python benchmarks/hang_recovery.py [--rounds 3] [--steps 200 --every 50 --hang-at 120]
                                                 [--pg-timeout-s 300] [--overhead-rounds 5 --overhead-steps 400]

The job is benchmarks/e2e_job.py (the example TorchRec DLRM on 2 CPU ranks, gloo, dense parts
compiled, a checkpoint every ``--every`` steps). Rank 1 hangs forever in Python once step
``--hang-at`` is done, in the first attempt (``LIGHTNING_ETT_FAULT_HANG=1:S:0``, applied by
ETTMonitor in both arms, which otherwise only measures in the vanilla arm).

* **pack**: ``lightning run --devices 2 --max-restarts 1`` + ETTStrategy, AsyncCheckpoint,
  CompileCache, DynamicShapes; the hang watch with its default timeouts.
* **vanilla**: stock Lightning (``DDPStrategy(timeout=--pg-timeout-s)``, synchronous
  ``ModelCheckpoint(save_top_k=1, save_last="link")``, ``fit(ckpt_path="last")`` on restart) started by
  ``torchrun --standalone --nproc-per-node 2 --max-restarts 1`` (with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, without which torchrun's restart cannot re-form the group).
  The process-group timeout is lowered from Lightning's default (30 min) so that the benchmark
  ends: rank 0's next collective then fails after that long, and torchrun stops the group and
  restarts it.

**Cost of the hang** = from the moment rank 1 hung (its last training step's end, from the
ledger) to the end of the first training step past ``--hang-at`` in the next attempt: detection,
stopping, restarting, reloading and the steps re-run from the last checkpoint. Both arms keep
inductor's default cache on the same host across attempts. Arms alternate their order per round.

**Detection overhead**: the same job without a hang or checkpoints, under ``lightning run`` with
and without the watch (``--no-hang-watch``), median step time (steps after the first 50, mean over
ranks) with ÷ without, per round; arms alternate.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.reference_job import BIN, JOB, env
from benchmarks.spread import median_range
from lightning_ett.instrument.ledger import RankLedger, read_ledger

GOAL_RATIO = 0.1
GOAL_OVERHEAD = 1.01
DEFAULT_PG_TIMEOUT_S = 1800.0  # Lightning's default for gloo and NCCL alike


def start(cmd: list[str], environ: dict[str, str], log: Path) -> float:
    """Run to the end, output to ``log``; returns the wall seconds (a failure is an error naming the log)."""
    began = time.time()
    with open(log, "w") as out:
        rc = subprocess.run(cmd, env=environ, stdout=out, stderr=subprocess.STDOUT, timeout=7200, check=False).returncode
    if rc != 0:
        raise RuntimeError(f"{cmd[0]} exited {rc}; the end of {log}:\n{log.read_text()[-4000:]}")
    return time.time() - began


def hang_cost(ledgers: list[RankLedger], hung_rank: int, hang_at: int) -> tuple[float, float]:
    """(seconds from the hang to the first new step's end, seconds from the hang to the next attempt's first event)."""
    first = min(lg.attempt for lg in ledgers)
    hung = [e for lg in ledgers if lg.attempt == first and lg.rank == hung_rank for e in lg.events
            if e["phase"] == "train" and e.get("step") == hang_at - 1]
    if not hung:
        raise RuntimeError(f"no training step {hang_at - 1} of rank {hung_rank} in attempt {first}: did the job hang?")
    t_hang = hung[0]["end"]
    later = [lg for lg in ledgers if lg.attempt > first]
    new = [min(e["end"] for e in lg.events if e["phase"] == "train" and (e.get("step") or -1) >= hang_at)
           for lg in later if any(e["phase"] == "train" and (e.get("step") or -1) >= hang_at for e in lg.events)]
    restarted = [min(e["start"] for e in lg.events) for lg in later if lg.events]
    if not new:
        raise RuntimeError("the job did not train past the hang in a later attempt")
    return max(new) - t_hang, min(restarted) - t_hang


def pack_arm(work: Path, job: list[str], hang: str, watch: bool = True) -> Path:
    work.mkdir(parents=True)
    cmd = [str(BIN / "lightning"), "run", "--devices", "2", "--max-restarts", "1", "--run-dir", str(work / "run"),
           *([] if watch else ["--no-hang-watch"]), JOB, "--arm", "pack", "--work", str(work),
           "--compile-cache", str(work.parent / "compile_cache"), *job]
    start(cmd, env(work.parent / "inductor", **({"LIGHTNING_ETT_FAULT_HANG": hang} if hang else {})),
          work / "launcher.log")
    return work / "run"


def vanilla_arm(work: Path, job: list[str], hang: str, pg_timeout_s: float) -> Path:
    work.mkdir(parents=True)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", JOB, "--arm",
           "vanilla", "--work", str(work), "--resume", "--pg-timeout-s", str(pg_timeout_s), *job]
    start(cmd, env(work.parent / "inductor", LIGHTNING_ETT_FAULT_HANG=hang, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   LIGHTNING_ETT_JOB_START=repr(time.time())), work / "torchrun.log")
    return work / "run"


def median_step_s(run_dir: Path, skip: int = 50) -> float:
    per_rank: dict[int, list[float]] = {}
    for lg in read_ledger(run_dir):
        per_rank.setdefault(lg.rank, []).extend(e["end"] - e["start"] for e in lg.events
                                                if e["phase"] == "train" and (e.get("step") or 0) >= skip)
    return statistics.mean(statistics.median(v) for v in per_rank.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--hang-at", type=int, default=120)
    p.add_argument("--pg-timeout-s", type=float, default=300.0)
    p.add_argument("--overhead-rounds", type=int, default=5, help="0 skips the detection-overhead part")
    p.add_argument("--overhead-steps", type=int, default=400)
    p.add_argument("--keep", default=None, help="keep the runs (logs, ledgers) under DIR")
    args = p.parse_args()
    job = ["--steps", str(args.steps), "--every", str(args.every)]
    hang = f"1:{args.hang_at}:0"

    with contextlib.ExitStack() as stack:
        tmp = Path(args.keep) if args.keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        tmp.mkdir(parents=True, exist_ok=True)
        print(f"== hang cost: {args.steps} steps, a checkpoint every {args.every}, rank 1 hangs after step "
              f"{args.hang_at}; vanilla process-group timeout {args.pg_timeout_s:g}s; {args.rounds} round(s)", flush=True)
        costs: dict[str, list[tuple[float, float]]] = {"pack": [], "vanilla": []}
        for r in range(args.rounds):
            arms = {"pack": lambda r=r: pack_arm(tmp / f"p{r}", job, hang),
                    "vanilla": lambda r=r: vanilla_arm(tmp / f"v{r}", job, hang, args.pg_timeout_s)}
            for name in (list(arms) if r % 2 == 0 else list(reversed(arms))):
                run_dir = arms[name]()
                costs[name].append(hang_cost(read_ledger(run_dir), 1, args.hang_at))
            print(f"round {r}: " + ", ".join(f"{n} {costs[n][-1][0]:.1f}s" for n in costs), flush=True)
        pack, vanilla = ([c[0] for c in costs[n]] for n in ("pack", "vanilla"))
        ratios = [a / b for a, b in zip(pack, vanilla)]
        print(f"{'':<44}{'pack':>22}{'vanilla':>22}")
        print(f"{'hang -> first new step (s)':<44}{median_range(pack, '.1f'):>22}{median_range(vanilla, '.1f'):>22}")
        print(f"{'hang -> next attempt first event (s)':<44}{median_range([c[1] for c in costs['pack']], '.1f'):>22}"
              f"{median_range([c[1] for c in costs['vanilla']], '.1f'):>22}")
        ratio = statistics.median(ratios)
        verdict = "met" if ratio <= GOAL_RATIO else "NOT met"
        print(f"pack / vanilla: {median_range(ratios, '.3f')} -> goal <= {GOAL_RATIO}: {verdict}")
        rest = statistics.median(v - args.pg_timeout_s for v in vanilla)  # stop, restart, reload, re-run
        at_default = DEFAULT_PG_TIMEOUT_S + rest
        print(f"at Lightning's default timeout: vanilla ~ {DEFAULT_PG_TIMEOUT_S:g} + {rest:.1f} (stop, restart, "
              f"reload, re-run) = {at_default:.0f}s; pack / vanilla ~ {statistics.median(pack) / at_default:.4f}")

        if args.overhead_rounds:
            print(f"== detection overhead: {args.overhead_steps} steps, no hang, no checkpoint; "
                  f"{args.overhead_rounds} round(s)", flush=True)
            quiet = ["--steps", str(args.overhead_steps), "--every", str(10 * args.overhead_steps)]
            with_watch, without = [], []
            for r in range(args.overhead_rounds):
                order = [True, False] if r % 2 == 0 else [False, True]
                for watch in order:
                    run_dir = pack_arm(tmp / f"o{r}-{'w' if watch else 'n'}", quiet, "", watch=watch)
                    (with_watch if watch else without).append(median_step_s(run_dir))
                print(f"round {r}: step {with_watch[-1] * 1e3:.2f} ms with the watch, {without[-1] * 1e3:.2f} ms "
                      "without", flush=True)
            over = [a / b for a, b in zip(with_watch, without)]
            verdict = "met" if statistics.median(over) <= GOAL_OVERHEAD else "NOT met"
            print(f"step time with ÷ without the watch: {median_range(over, '.4f')} -> goal <= {GOAL_OVERHEAD}: {verdict}")


if __name__ == "__main__":
    main()
