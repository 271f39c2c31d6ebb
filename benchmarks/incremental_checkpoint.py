"""Incremental checkpoints vs full saves vs DCP async_save: bytes written per hour, save cost, restore time.

    .venv/bin/python benchmarks/incremental_checkpoint.py [--gib 2] [--rounds 3] [--dir DIR]

Every job (incremental_job.py): ETTStrategy on 2 gloo ranks, GIB GiB of TorchRec tables (8 tables
of 64-wide fp32 rows, table-wise, fused row-wise AdaGrad), 512 ids per table per rank per step.
Configurations: a Zipf id stream (exponent 1.05, see the README) with saves every 10, 50 and 200
steps, and a uniform stream (the worst case for deltas) every 50 steps. Arms: ``full``
(AsyncCheckpoint), ``incremental`` (AsyncCheckpoint(incremental=True)), ``dcp_async`` (DCP
async_save with reused buffers) and ``full A/A`` (the full arm again: the noise). Same
retention in every arm (the newest checkpoint kept, plus what an incremental chain needs); a save
due while one is in flight is skipped in every arm. The order of the arms in each round is a
Williams design (spread.round_order). Per job: bytes written by the window's saves per hour of
its wall time, the bytes of each save, the saves made and skipped, the training time the saves
cost (blocked + slowdown: window wall minus window steps x the step time without saves).

Goals (issue #34): on the Zipf stream at the 50-step cadence, >= 6x fewer bytes written per hour
than full saves; restore <= 1.5x a full restore (``--restore`` jobs: the incremental arm keeping
every checkpoint, each restored cold on 2 ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from spread import aa_floor, median_range, round_order

ARMS = ("full", "incremental", "dcp_async", "full A/A")
#: stream, every, window steps. Zipf every 50 (the goal's) runs 1600 steps (32 saves due): past the job's first
#: full save and its first chains (12 deltas, then rebases with fewer deltas after each), a job's steady state.
CONFIGS = (("zipf", 10, 300), ("zipf", 50, 1600), ("zipf", 200, 1000), ("uniform", 50, 600))
RESTORE_WINDOW = 1000  # steps: a chain to the policy's bound (12 deltas of this stream every 50 steps), a rebase and more


def job(arm: str, stream: str, every: int, window: int, gib: float, base: Path, *extra: str) -> dict:
    root, out = base / "ckpt", base / "result.json"
    shutil.rmtree(root, ignore_errors=True)
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env["PYTHONPATH"] = str(HERE.parent)
    proc = subprocess.run([sys.executable, str(HERE / "incremental_job.py"), "--arm", arm.split()[0], "--stream", stream,
                           "--every", str(every), "--window", str(window), "--gib", str(gib), "--dir", str(root),
                           "--out", str(out), *extra], env=env, capture_output=True, text=True, timeout=3600, check=False)
    shutil.rmtree(root, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} {stream}/{every} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def report_config(stream: str, every: int, runs: dict[str, list[dict]]) -> None:
    mib = 2**20
    print(f"\n== {stream} ids, a save every {every} steps: {len(runs['full'])} rounds, median (min-max) ==")
    touched = [f for r in runs["incremental"] for f in r["touched_fraction"][1:]]
    print(f"rows touched per interval (all tables): {median_range(touched, '.4f')}")
    print(f"{'arm':<13}{'GB written/h':>24}{'MiB per save (full / delta)':>32}{'saves':>7}{'skipped':>9}"
          f"{'cost s per save':>24}")
    for arm in ARMS:
        rs = runs[arm]
        gb_h = median_range([r["bytes_per_hour"] / 1e9 for r in rs], ".1f")
        fulls = [s["bytes"] / mib for r in rs for s in r["saves"] if s["kind"] == "full"]
        deltas = [s["bytes"] / mib for r in rs for s in r["saves"] if s["kind"] == "delta"]
        rebases = [s["bytes"] / mib for r in rs for s in r["saves"] if s["kind"] == "rebase"]
        sizes = f"{statistics.median(fulls):.0f}" + (f" / {statistics.median(deltas):.1f}" if deltas else "") + (
            f" / R {statistics.median(rebases):.0f}" if rebases else "")
        cost = median_range([r["cost_s"] / max(len(r["saves"]), 1) for r in rs], ".3f")
        print(f"{arm:<13}{gb_h:>24}{sizes:>32}{statistics.median(len(r['saves']) for r in rs):>7.0f}"
              f"{statistics.median(r['skipped'] for r in rs):>9.0f}{cost:>24}")
    ratio = [f["bytes_per_hour"] / i["bytes_per_hour"] for f, i in zip(runs["full"], runs["incremental"])]
    aa = [a["bytes_per_hour"] / b["bytes_per_hour"] for a, b in zip(runs["full"], runs["full A/A"])]
    dcp = [d["bytes_per_hour"] / i["bytes_per_hour"] for d, i in zip(runs["dcp_async"], runs["incremental"])]
    print(f"full / incremental bytes per hour, per round: {median_range(ratio, '.2f')} "
          f"(A/A full / full: {median_range(aa, '.3f')}, floor ±{aa_floor(aa):.3f}); dcp_async / incremental: "
          f"{median_range(dcp, '.2f')}")
    print("every run (GB/h; saves full+delta+rebase): " + "; ".join(
        f"{arm} " + " | ".join(f"{r['bytes_per_hour'] / 1e9:.1f} ({sum(s['kind'] == 'full' for s in r['saves'])}+"
                               f"{sum(s['kind'] == 'delta' for s in r['saves'])}+"
                               f"{sum(s['kind'] == 'rebase' for s in r['saves'])})" for r in runs[arm]) for arm in ARMS),
          flush=True)
    for r in runs["incremental"]:
        print("  incremental saves in order (F full, d delta, R rebase): " + "".join(
            {"full": "F", "delta": "d", "rebase": "R"}[s["kind"]] for s in r["saves"]))


def report_policies(stream: str, every: int, runs: list[dict]) -> None:
    """Consecutive deltas vs a one-shot differential (each against the full save), from the rows each interval of
    the incremental arm's id stream touched (looked-up rows are the rows that change): rows written over k saves
    after a full one, and rows a restore of the k-th reads (a consecutive chain: all k; a differential: its last)."""
    print(f"\n== {stream}/{every}: chain policies from the measured id stream (fraction of all table rows, median over "
          f"runs); after a full save, k saves: written = consecutive / one-shot; restore reads = consecutive / one-shot ==")
    for k in (1, 2, 4, 8, 14, 24):
        if any(len(r.get("touched_since_first") or []) <= k for r in runs):
            break
        consecutive = [sum(r["touched_fraction"][1:k + 1]) for r in runs]
        one_shot = [sum(r["touched_since_first"][1:k + 1]) for r in runs]
        last = [r["touched_since_first"][k] for r in runs]
        print(f"  k = {k:>2}: written {statistics.median(consecutive):.4f} / {statistics.median(one_shot):.4f} "
              f"(one-shot x{statistics.median(o / max(c, 1e-12) for o, c in zip(one_shot, consecutive)):.2f}); restore reads "
              f"{statistics.median(consecutive):.4f} / {statistics.median(last):.4f}", flush=True)


def report_restores(runs: list[dict]) -> None:
    """Each chain's restore against its own full save's (the base it builds on, in the same job), cold and warm:
    per checkpoint the median of its repeats; per chain length, median (min-max) over the jobs. The full saves'
    own repeats are the A/A control: how far one restore of the same files strays from their median."""
    print("\n== restore (2 ranks, slowest rank) against chain length: incremental arm, zipf, every 50, its own chain "
          "policy (or --restore-full-every),\n    every checkpoint of the window kept; each restored 3x cold (pages dropped) "
          "and 3x warm ==")
    for mode in ("cold", "warm"):
        by_path: dict[str, list[float]] = {}
        ratios: dict[str, list[float]] = {}
        worst: list[float] = []  # per job: its slowest restore / its full save's (the goal: every restore <= 1.5x)
        aa: list[float] = []
        for run in runs:
            by_name = {r["base"]: statistics.median(r[mode]) for r in run["restores"] if r["deltas"] == 0}
            job = []
            for r in run["restores"]:
                path = r.get("path", "d" * r["deltas"])
                by_path.setdefault(path, []).append(statistics.median(r[mode]))
                if r["deltas"] == 0:
                    aa += [s / statistics.median(r[mode]) for s in r[mode]]
                elif r["base"] in by_name:
                    ratios.setdefault(path, []).append(statistics.median(r[mode]) / by_name[r["base"]])
                    job.append(ratios[path][-1])
            worst += [max(job)] if job else []
        print(f"  {mode}: a full save's repeats / their median (A/A): {median_range(aa, '.2f')}")
        for path in sorted(by_path, key=lambda p: (len(p), p)):
            own = f"  x its full save's restore {median_range(ratios[path], '.2f')}" if path in ratios else ""
            shown = f"{len(path)} deltas" + (f" ({path})" if "R" in path else "")
            print(f"  {mode} full + {shown:<24}: {median_range(by_path[path], '.2f')} s{own}")
        if worst:
            print(f"  {mode}: each job's slowest restore x its full save's: {median_range(worst, '.2f')} "
                  f"(every job: {', '.join(f'{w:.2f}' for w in worst)})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary directory)")
    parser.add_argument("--configs", default="all", help="indices into CONFIGS (0,2), 'all' or 'none' (only restores)")
    parser.add_argument("--restore-full-every", type=int, default=None,
                        help="restore jobs: chains of this many saves (full_every_n_saves), to measure the cost of "
                             "chains longer than the policy makes (default: the policy's own chains)")
    parser.add_argument("--restore-window", type=int, default=RESTORE_WINDOW, help="restore jobs: steps with saves")
    args = parser.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ett-incremental-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    named = {"all": list(CONFIGS), "none": []}
    configs = named[args.configs] if args.configs in named else [CONFIGS[int(i)] for i in args.configs.split(",")]
    print(f"machine: {os.cpu_count()} CPUs; {args.gib:g} GiB of tables; checkpoints under {base}", flush=True)
    restores: list[dict] = []
    for stream, every, window in configs:
        runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for r in range(args.rounds):
            order = round_order(ARMS, r)
            for arm in order:
                runs[arm].append(job(arm, stream, every, window, args.gib, base))
            print(f"  {stream}/{every} round {r + 1}: order {', '.join(order)}; GB/h "
                  + ", ".join(f"{a} {runs[a][-1]['bytes_per_hour'] / 1e9:.1f}" for a in ARMS), flush=True)
        report_config(stream, every, runs)
        report_policies(stream, every, runs["incremental"])
    forced = ("--full-every", str(args.restore_full_every)) if args.restore_full_every else ()
    for r in range(args.rounds):
        restores.append(job("incremental", "zipf", 50, args.restore_window, args.gib, base, "--restore", *forced))
    report_restores(restores)
    (base / "restores.json").write_text(json.dumps([r["restores"] for r in restores], indent=1))  # every job's raw figures
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
