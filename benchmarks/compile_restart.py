"""Time to the first finished training step: a cold start vs restarts that reuse CompileCache.

    .venv/bin/python benchmarks/compile_restart.py [--rounds 2]

The example DLRM on one CPU process, compiled by CompileCache(compile_module=True), each start
a fresh process with an empty default inductor directory (what a restart on another host
has). Arms: cold (empty cache dir); warm restart (the cold run's cache dir, on shared
storage); bundle only (a new cache dir holding only the portable mega-cache bundle).
Goal: warm <= 25 % of cold.
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


def start(cache: Path, tmp: Path, name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env.update(PYTHONPATH=str(HERE.parent), TORCHINDUCTOR_CACHE_DIR=str(tmp / f"default-{name}"))
    out = tmp / f"{name}.json"
    proc = subprocess.run([sys.executable, str(HERE / "compile_restart_job.py"), "--cache-dir", str(cache), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=1200, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(out.read_text())


def under_launcher(tmp: Path, name: str) -> dict:
    """A job under `lightning run` whose worker is SIGKILLed after its first step, then restarted.

    Returns the cold start (launcher start -> end of attempt 0's first step, empty cache) and the
    restart (the agent starting attempt 1 -> end of its first step): what a restart costs in the
    pack's own deployment, where workers are forked from a pre-imported server.
    """
    sys.path.insert(0, str(HERE.parent))
    from lightning_ett.instrument.ledger import read_launcher_records, read_ledger

    run_dir = tmp / f"{name}-run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env.update(PYTHONPATH=str(HERE.parent), TORCHINDUCTOR_CACHE_DIR=str(tmp / f"default-{name}"),
               LIGHTNING_ETT_FAULT_KILL="0:1:0")
    cmd = [str(Path(sys.executable).parent / "lightning"), "run", "--max-restarts", "1", "--run-dir", str(run_dir),
           str(HERE / "compile_restart_job.py"), "--cache-dir", str(tmp / f"{name}-cache"), "--out",
           str(tmp / f"{name}.json"), "--monitor"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    records = read_launcher_records(run_dir)
    started = {r["attempt"]: r["time"] for r in records if r["kind"] == "attempt"}
    job_start = min(r["job_start"] for r in records if r["kind"] == "launch")
    first_step = {lg.attempt: min(e["end"] for e in lg.events if e["phase"] == "train") for lg in read_ledger(run_dir)}
    return {"cold_s": first_step[0] - job_start, "restart_s": first_step[1] - started[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--launcher", action="store_true", help="also measure a restart under `lightning run`")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"cold": [], "warm restart": [], "bundle only": []}
    launched: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in range(args.rounds):
            cache, moved = tmp / f"cache{r}", tmp / f"moved{r}"
            runs["cold"].append(start(cache, tmp, f"cold{r}"))
            runs["warm restart"].append(start(cache, tmp, f"warm{r}"))
            moved.mkdir()
            for name in ("mega_cache.bin", "mega_cache.json"):
                shutil.copy(cache / name, moved / name)
            runs["bundle only"].append(start(moved, tmp, f"bundle{r}"))
            if args.launcher:
                launched.append(under_launcher(tmp, f"launched{r}"))
    cold = statistics.median(x["first_step_s"] for x in runs["cold"])
    print(f"{'arm':<14}{'first step s':>14}{'compile s':>11}{'dynamo s':>10}{'backend s':>11}{'fx hits':>9}{'ratio':>8}")
    for arm, xs in runs.items():
        med = {k: statistics.median(x[k] for x in xs) for k in ("first_step_s", "compile_s", "compile/dynamo_s",
                                                                 "compile/backend_s", "compile/fx_cache_hits")}
        print(f"{arm:<14}{med['first_step_s']:>14.2f}{med['compile_s']:>11.2f}{med['compile/dynamo_s']:>10.2f}"
              f"{med['compile/backend_s']:>11.2f}{med['compile/fx_cache_hits']:>9.0f}{med['first_step_s'] / cold:>8.3f}")
    print(f"(medians of {args.rounds} rounds; goal: warm restart <= 0.25 of cold)")
    if launched:
        lr_cold = statistics.median(x["cold_s"] for x in launched)
        lr_restart = statistics.median(x["restart_s"] for x in launched)
        print(f"under `lightning run` (worker SIGKILLed after its first step, restarted; medians of {len(launched)}):")
        print(f"  cold start, launcher start -> first step   {lr_cold:8.2f} s")
        print(f"  restart, agent restart -> first step        {lr_restart:8.2f} s   "
              f"÷ that cold start {lr_restart / lr_cold:.3f}   ÷ plain cold {lr_restart / cold:.3f}")


if __name__ == "__main__":
    main()
