"""The first attempt's start: ``lightning run`` vs ``torchrun --standalone``, same script, 2 ranks.

    .venv/bin/python benchmarks/launch_start.py [--rounds 5] [--steps 5] [--arm pack|vanilla]

The script is the user-style job of e2e_ett.py (benchmarks/e2e_user_job.py, ``--arm pack`` by
default: ETTStrategy, ETTMonitor, AsyncCheckpoint, an offline WandbLogger), ``--steps`` steps, no
failure. Measured: from this script's ``time.time()`` just before it starts the launcher to the
end of the first training step of the first attempt (the earliest ``train`` event of each rank
in the ETTMonitor ledger; the job's figure is the slowest rank).

* **torchrun**: ``torchrun --standalone --nproc-per-node 2 SCRIPT ...`` with
  ``LIGHTNING_ETT_RUN_DIR`` set, so ETTMonitor writes its ledger there.
* **lightning run**: ``lightning run --devices 2 --run-dir RUN_DIR SCRIPT ...``.
* **torchrun A/A**: torchrun again; torchrun A/A / torchrun sizes the noise.

Same environment for both (W&B offline, an empty default inductor directory per launch,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which ``lightning run`` sets anyway); the arms' order is
``round_order``'s (a balanced Latin square), after one untimed launch of each launcher.
Prints medians with the spread (min-max), the ratio
lightning run / torchrun (goal <= 1.0), and per arm where the slowest rank's time went: every
phase its ledger holds up to the end of that first step, the innermost event owning the time as
in the ETT report, ``launch`` being the gap from the launcher's start to the rank's first event.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.reference_job import BIN, env
from benchmarks.spread import median_range, round_order
from lightning_ett.instrument.ledger import read_ledger
from lightning_ett.instrument.summary import summarize
from lightning_ett.instrument.timeline import PHASE_NAMES

USER_JOB = str(HERE / "e2e_user_job.py")
ARMS = ("torchrun", "lightning run", "torchrun A/A")


def command(arm: str, work: Path, script_args: list[str]) -> list[str]:
    if arm.startswith("torchrun"):
        return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", USER_JOB, *script_args]
    return [str(BIN / "lightning"), "run", "--devices", "2", "--run-dir", str(work / "run"), USER_JOB, *script_args]


def first_step(run_dir: Path, t0: float) -> dict[int, dict[str, float]]:
    """Per rank of attempt 0: seconds from ``t0`` to the end of its first training step, and by phase."""
    ledgers = [lg for lg in read_ledger(run_dir) if lg.attempt == 0]
    # A launch record at t0 makes the summary's clock start there: `launch` = t0 -> the rank's first event.
    summary = summarize(ledgers, launcher=[{"kind": "launch", "time": t0}])
    out = {}
    for lg in ledgers:
        trains = [e["end"] for e in lg.events if e["phase"] == "train"]
        if not trains:
            raise RuntimeError(f"rank {lg.rank} of {run_dir} recorded no training step")
        until = min(trains)
        phases = dict.fromkeys(PHASE_NAMES, 0.0)
        for seg in summary.segments[lg.rank]:
            if seg.start < until:
                phases[seg.phase] += min(seg.end, until) - seg.start
        out[lg.rank] = {"total": until - t0, **phases}
    return out


def one_start(arm: str, work: Path, script_args: list[str]) -> tuple[dict[int, dict[str, float]], float]:
    work.mkdir(parents=True)
    environ = env(work / "inductor", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if arm.startswith("torchrun"):
        environ["LIGHTNING_ETT_RUN_DIR"] = str(work / "run")
    cmd = command(arm, work, ["--work", str(work), *script_args])
    log = work / "launcher.log"
    with open(log, "w") as out:
        t0 = time.time()
        rc = subprocess.run(cmd, env=environ, stdout=out, stderr=subprocess.STDOUT, timeout=1800, check=False).returncode
        exited = time.time() - t0
    if rc != 0:
        raise RuntimeError(f"{arm} exited {rc}; the end of {log}:\n{log.read_text()[-4000:]}")
    return first_step(work / "run", t0), exited


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--arm", choices=["pack", "vanilla"], default="pack", help="which configuration of the job script")
    p.add_argument("--keep", default=None, help="keep the runs (logs, ledgers) under this directory")
    args = p.parse_args()
    script_args = ["--arm", args.arm, "--steps", str(args.steps)]

    slowest: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}  # per round: the slowest rank's figures
    per_rank: dict[str, dict[int, list[float]]] = {a: {} for a in ARMS}
    exits: dict[str, list[float]] = {a: [] for a in ARMS}
    with contextlib.ExitStack() as stack:
        root = Path(args.keep) if args.keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for arm in ARMS[:2]:  # untimed: the first launch of each launcher reads its files into the page cache
            one_start(arm, root / f"warmup-{arm.replace(' ', '_')}", script_args)
        for r in range(args.rounds):
            order = round_order(ARMS, r)
            line = []
            for arm in order:
                ranks, exited = one_start(arm, root / f"r{r}-{arm.replace(' ', '_').replace('/', '_')}", script_args)
                slowest[arm].append(max(ranks.values(), key=lambda x: x["total"]))
                for rank, figures in ranks.items():
                    per_rank[arm].setdefault(rank, []).append(figures["total"])
                exits[arm].append(exited)
                line.append(f"{arm} {slowest[arm][-1]['total']:.2f}s")
            print(f"round {r}: " + ", ".join(line), flush=True)

    width = 24

    def row(label: str, values: Callable[[str], list[float]]) -> str:
        return f"{label:<36}" + "".join(f"{median_range(values(a)):>{width}}" for a in ARMS)

    print(f"\n{'seconds, launcher start ->':<36}" + "".join(f"{a:>{width}}" for a in ARMS))
    print(row("first step done, slowest rank", lambda a: [x["total"] for x in slowest[a]]))
    for rank in sorted(per_rank[ARMS[0]]):
        print(row(f"  rank {rank}", lambda a: per_rank[a].get(rank, [0.0])))  # noqa: B023 - used at once
    print(row(f"launcher exit ({args.steps} steps, info)", lambda a: exits[a]))
    print("breakdown of the slowest rank (medians; phases as the ledger has them):")
    for phase in PHASE_NAMES:
        if max(x[phase] for a in ARMS for x in slowest[a]) >= 0.005:
            print(f"{'  ' + phase:<36}" + "".join(f"{median_range([x[phase] for x in slowest[a]]):>{width}}" for a in ARMS))
    ratios = [lr["total"] / tr["total"] for lr, tr in zip(slowest["lightning run"], slowest["torchrun"])]
    print(f"{'ratio lightning run / torchrun':<36}{'':>{width}}{median_range(ratios, '.3f'):>{width}}")
    control = [aa["total"] / tr["total"] for aa, tr in zip(slowest["torchrun A/A"], slowest["torchrun"])]
    print(f"{'A/A: torchrun A/A / torchrun':<36}{'':>{width}}{'':>{width}}{median_range(control, '.3f'):>{width}}")
    verdict = "met" if statistics.median(ratios) <= 1.0 else "NOT met"
    print(f"(medians of {args.rounds} round(s), min-max in brackets, ratio per round; goal <= 1.0: {verdict})")


if __name__ == "__main__":
    main()
