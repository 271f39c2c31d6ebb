"""Two hosts, three faults: the time from the fault to training again, and the work lost (issue #36).

    .venv/bin/python benchmarks/node_recovery.py [--rounds 3] [--cases worker,node,partition] [--cap-s 240]

Needs root (two Linux network namespaces, ``tests/multihost/hosts.py``), with a hostname of their
own on each host that resolves to its address on the pair: the set-up in which plain ``torchrun``
works unaided, so neither arm needs the pack's address handling.

The job is ``tests/scripts/ett_job.py`` on one CPU rank per host: a sharded DLRM under
``ETTStrategy`` (gloo), 120 steps of ~0.1 s, a checkpoint every 10 steps, ETTMonitor's ledger.
Arms (identical training: same script, model, optimizer, data, steps, fault):

* **pack**: ``lightning run --max-restarts 2`` on each host, ``AsyncCheckpoint(every_n_train_steps=10)``.
* **torchrun**: ``torchrun --max-restarts 2`` on each host (c10d rendezvous on host 0, the same
  endpoint), a synchronous ``ModelCheckpoint(every_n_train_steps=10, save_last="link")`` and
  ``fit(ckpt_path="last")``; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` as the pack sets it (without
  it, torch 2.13's restarted group reads the dead attempt's store and hangs: a competent user's fix).
* **torchrun A/A**: the torchrun arm again in the same round, for the noise.

Faults, each after step 45 of the first attempt (rank 0's ledger; the last checkpoint before it is step 40):

* ``worker``: rank 1 SIGKILLed (``LIGHTNING_ETT_FAULT_KILL=1:45``).
* ``node``: every process of host 1 SIGKILLed, launcher included; a replacement launcher is started on
  host 1 20 s later in both arms (the scheduler's part, the same for both).
* ``partition``: host 1's link down for 60 s, then up. No A/A arm here (one torchrun run per round,
  capped at ``--cap-s``): torchrun's ranks resume in place when the link is back (TCP outlives a
  60 s outage), but its node-1 agent dies on the rendezvous store's timeout meanwhile, and node 0's
  agent then waits for it in the exit barrier (300 s) past the cap.

Measured from the ledgers of both ranks (raw train events, whatever their attempt numbers):
**recovery** = fault -> the end of the first step started after it that is either run again (a
restart resumed from a checkpoint) or started over 5 s after the fault (the group resumed in place,
as TCP lets it after a short partition); **lost** = the steps run again (the last step
started before that one - the step resumed from + 1), and their seconds at the median step time.
The fault's time is rank 1's end of step 45
(``worker``) or the moment this script injected it (``node``, ``partition``). Arms alternate in
``round_order``; medians with their range, every run listed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.reference_job import BIN
from benchmarks.spread import median_range, round_order
from tests.multihost.hosts import TwoHosts, namespaces_unavailable

JOB = str(HERE.parent / "tests" / "scripts" / "ett_job.py")
STEPS, EVERY, STEP_SLEEP, FAULT_STEP = 120, 10, 0.1, 45  # (mid-interval: the last checkpoint is step 40)
PORT = "29500"
REPLACE_AFTER_S = 20.0
PARTITION_S = 60.0
ARMS = ("pack", "torchrun", "torchrun A/A")
IN_FLIGHT_S = 5.0  # a step that started within this long after the fault was already under way


@dataclass
class Run:
    case: str
    arm: str
    ok: bool
    recovery_s: float | None
    lost_steps: int | None
    lost_s: float | None
    wall_s: float
    note: str = ""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env.update(PYTHONPATH=str(HERE.parent), WANDB_MODE="offline", PYTHONUNBUFFERED="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **extra)
    return env


def _argv(arm: str, hosts: TwoHosts, node: int, work: Path) -> list[str]:
    job = [JOB, "--out", str(work / "out"), "--devices", "1", "--num-nodes", "2", "--max-steps", str(STEPS),
           "--step-sleep", str(STEP_SLEEP), "--ckpt-dir", str(work / "ckpt")]
    if arm == "pack":
        return [str(BIN / "lightning"), "run", "--num-nodes", "2", "--node-rank", str(node), "--devices", "1",
                "--main-address", hosts.address(0), "--main-port", PORT, "--run-dir", str(work / "run"),
                "--max-restarts", "2", "--progress-every", "0", *job, "--async-every", str(EVERY), "--ett-from-env"]
    return [str(BIN / "torchrun"), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.address(0)}:{PORT}", "--rdzv-id", "bench",
            "--rdzv-conf", f"is_host={str(node == 0).lower()}", "--max-restarts", "2", *job,
            "--save-every", str(EVERY), "--resume", "last"]


def _train_events(work: Path) -> list[dict]:
    """Every train event of every rank (the pack's ledger in run/, torchrun's ETTMonitor's in out/ett/)."""
    events = []
    for path in list(work.glob("run/ledger/attempt-*/rank-*.jsonl")) + list(work.glob("out/ett/ledger/attempt-*/rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("kind") == "event" and record.get("phase") == "train" and record.get("step") is not None:
                events.append({**record, "rank": rank})
    return events


def _steps_done(work: Path, rank: int = 0) -> int:
    return sum(1 for e in _train_events(work) if e["rank"] == rank)


def measure(work: Path, fault_time: float | None) -> tuple[float | None, int | None, float | None]:
    events = _train_events(work)
    if fault_time is None:  # the worker case: the end of rank 1's last step before its steps went back (the restart)
        mine = sorted((e for e in events if e["rank"] == 1), key=lambda e: e["start"])
        cut = next((i for i in range(1, len(mine)) if mine[i]["step"] <= mine[i - 1]["step"]), len(mine))
        if not mine:
            return None, None, None
        fault_time = mine[cut - 1]["end"]
    # Training again: the first step started after the fault that is run again (a restart resumed from a
    # checkpoint), or that started more than IN_FLIGHT_S after it (the group resumed in place, as TCP allows).
    again = [e for e in events if e["start"] > fault_time and (e["step"] <= FAULT_STEP or e["start"] > fault_time + IN_FLIGHT_S)]
    if not again:
        return None, None, None
    first = min(again, key=lambda e: e["start"])
    before = [e for e in events if e["start"] < first["start"]]
    lost = max(0, max(e["step"] for e in before) - first["step"] + 1)
    step_s = statistics.median(e["end"] - e["start"] for e in before)
    return first["end"] - fault_time, lost, lost * step_s


def one_run(case: str, arm: str, tmp: Path, cap_s: float) -> Run:
    work = Path(tempfile.mkdtemp(prefix=f"{case}-{arm.replace(' ', '').replace('/', '')}-", dir=tmp))
    (work / "out").mkdir()
    hosts = TwoHosts(tag=str(os.getpid() % 100000), hostnames="per_host")
    extra = {"LIGHTNING_ETT_FAULT_KILL": f"1:{FAULT_STEP}"} if case == "worker" else {}
    start = time.monotonic()
    fault_time, note = None, ""
    try:
        hosts.create()
        procs = [hosts.start(n, _argv(arm, hosts, n, work), work / f"node{n}.log", _env(**extra), work) for n in (0, 1)]
        deadline = start + cap_s
        if case != "worker":
            while _steps_done(work) < FAULT_STEP and time.monotonic() < deadline:
                time.sleep(0.05)
            fault_time = time.time()
            if case == "node":
                hosts.kill_host(1)
                time.sleep(REPLACE_AFTER_S)
                procs[1] = hosts.start(1, _argv(arm, hosts, 1, work), work / "node1b.log", _env(), work)
            else:
                hosts.set_link(1, up=False)
                time.sleep(PARTITION_S)
                hosts.set_link(1, up=True)
        while procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        ok = procs[0].poll() == 0
        if procs[0].poll() is None:
            note = f"not finished after {cap_s:.0f} s (capped)"
        elif not ok:
            note = f"node 0 exited {procs[0].poll()}"
    finally:
        wall = time.monotonic() - start
        hosts.destroy()
    recovery, lost, lost_s = measure(work, fault_time)
    if recovery is None and not note:
        note = "no training after the fault"
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    return Run(case, arm, ok, recovery, lost, lost_s, wall, note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default="worker,node,partition")
    parser.add_argument("--cap-s", type=float, default=240.0, help="a run still going after this long is stopped")
    parser.add_argument("--out", default=None, help="write every run as JSON here")
    args = parser.parse_args()
    if (why := namespaces_unavailable()) is not None:
        sys.exit(f"node_recovery: {why}")
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="node_recovery-") as tmp:
        for case in args.cases.split(","):
            for r in range(args.rounds):
                arms = round_order(ARMS, r)
                if case == "partition":  # torchrun does not recover: one capped run per round, no A/A
                    arms = [a for a in arms if a != "torchrun A/A"]
                for arm in arms:
                    run = one_run(case, arm, Path(tmp), args.cap_s)
                    runs.append(run)
                    print(f"{case:9s} round {r} {arm:13s} recovery {_fmt(run.recovery_s)} s, lost {run.lost_steps} "
                          f"step(s) ({_fmt(run.lost_s)} s), wall {run.wall_s:.1f} s, ok {run.ok} {run.note}", flush=True)
    print()
    for case in args.cases.split(","):
        for arm in ARMS:
            mine = [r for r in runs if r.case == case and r.arm == arm]
            if not mine:
                continue
            rec = [r.recovery_s for r in mine if r.recovery_s is not None and r.ok]
            lost = [float(r.lost_steps) for r in mine if r.lost_steps is not None and r.ok]
            print(f"{case:9s} {arm:13s} recovered {len(rec)}/{len(mine)}; fault -> training again "
                  f"{median_range(rec, '.1f') if rec else '-'} s; steps lost {median_range(lost, '.0f') if lost else '-'}")
    if args.out:
        Path(args.out).write_text(json.dumps([vars(r) for r in runs], indent=1))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()
