"""Time to the first finished training step of a compiled job: its cold start, then its first and second restart.

    .venv/bin/python benchmarks/compile_restart.py [--rounds 3] [--models dlrm,mlp] [--kill-step 3]

Each model runs as one job under `lightning run --max-restarts 2` (1 CPU process) with
CompileCache(cache_dir=...): its worker is SIGKILLed after step ``--kill-step`` of attempts 0
and 1 (``LIGHTNING_ETT_FAULT_KILL``), and attempt 2 trains to the end. Every attempt is a fresh
process whose default inductor directory (``TORCHINDUCTOR_CACHE_DIR``) is new and empty, as on
another host; the CompileCache directory carries over, like shared storage. Models:

* ``dlrm``: the example DLRM, compiled by CompileCache(compile_module=True);
* ``mlp``: a user's own LightningModule, an MLP with ``self.net = torch.compile(...)``, trained
  on batches of four sizes with DynamicShapes().

Times, from the job's ledger and the launcher's records:

* cold: the launcher's start -> the end of attempt 0's first training step;
* first restart: the kill (the end of attempt 0's last step, right after which its worker
  SIGKILLs itself) -> the end of attempt 1's first step. It includes failure detection,
  teardown, re-rendezvous and the new worker's start-up, not only its compile;
* second restart: the same from attempt 1's kill to attempt 2's first step.

Prints medians and the spread (min-max) over ``--rounds`` rounds, each restart's ratio to its
round's cold start (goal: first restart <= 0.25 of cold), and what each attempt's first step
compiled: FX-graph / AOTAutograd cache hits and C++ compiler runs (a warm CPU restart runs one,
inductor's ~0.1 s header preprocessing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.spread import median_range

ARMS = ("cold", "first restart", "second restart")


def one_job(model: str, tmp: Path, kill_step: int) -> dict[str, dict]:
    """Run one job through its cold start and two restarts; returns per-arm seconds and first-step facts."""
    from lightning_ett.instrument.ledger import read_launcher_records, read_ledger

    run_dir, out = tmp / "run", tmp / "out"
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env.update(PYTHONPATH=str(HERE.parent), TORCHINDUCTOR_CACHE_DIR=str(tmp / "default-launcher"),
               LIGHTNING_ETT_FAULT_KILL=f"0:{kill_step}:0,0:{kill_step}:1")
    cmd = [str(Path(sys.executable).parent / "lightning"), "run", "--devices", "1", "--max-restarts", "2",
           "--run-dir", str(run_dir), str(HERE / "compile_restart_job.py"), "--model", model,
           "--cache-dir", str(tmp / "compile-cache"), "--default-inductor-root", str(tmp / "default-inductor"),
           "--out", str(out), "--max-steps", str(kill_step + 2)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{model}: `lightning run` exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    records = read_launcher_records(run_dir)
    job_start = min(r["job_start"] for r in records if r["kind"] == "launch")
    failed = {r["attempt"] for r in records if r["kind"] == "failure"}
    steps = {lg.attempt: sorted(e["end"] for e in lg.events if e["phase"] == "train") for lg in read_ledger(run_dir, {0})}
    if failed != {0, 1} or sorted(steps) != [0, 1, 2] or not all(steps.values()):
        raise RuntimeError(f"{model}: expected attempts 0 and 1 to fail after step {kill_step} and attempt 2 to train; "
                           f"failures {sorted(failed)}, attempts with steps {sorted(steps)}")
    started = [job_start, steps[0][-1], steps[1][-1]]  # launcher start, first kill, second kill
    facts = {a: json.loads((out / f"attempt-{a}.json").read_text()) for a in range(3)}
    return {arm: {"s": steps[a][0] - started[a], **facts[a]} for a, arm in enumerate(ARMS)}


def report(model: str, rounds: list[dict[str, dict]]) -> None:
    print(f"\n{model}: seconds to the end of the first training step (median (min-max) of {len(rounds)} rounds)")
    print(f"  {'arm':<16}{'from':<28}{'seconds':>22}{'ratio to cold':>24}{'fx hit/miss':>13}{'aot hit/miss':>13}"
          f"{'C++ runs':>9}{'C++ s':>7}")
    froms = ("launcher start", "the kill of attempt 0", "the kill of attempt 1")
    for arm, origin in zip(ARMS, froms):
        xs = [r[arm] for r in rounds]
        ratios = [r[arm]["s"] / r["cold"]["s"] for r in rounds]

        def med(key: str) -> float:
            return statistics.median(x[key] for x in xs)  # noqa: B023 - used at once

        print(f"  {arm:<16}{origin:<28}{median_range([x['s'] for x in xs], '.2f'):>22}{median_range(ratios, '.3f'):>24}"
              f"{med('compile/fx_cache_hits'):>7.0f}/{med('compile/fx_cache_misses'):<5.0f}"
              f"{med('compile/aot_cache_hits'):>7.0f}/{med('compile/aot_cache_misses'):<5.0f}"
              f"{med('compile/cpp_compiles'):>9.0f}{med('compile/cpp_compile_s'):>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="dlrm,mlp", help="comma-separated: dlrm, mlp")
    parser.add_argument("--kill-step", type=int, default=3, help="SIGKILL attempts 0 and 1 after this step (>= 2)")
    parser.add_argument("--json", default=None, help="also write every round's figures to this file")
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not set(models) <= {"dlrm", "mlp"} or not models:
        parser.error(f"--models {args.models!r}: expected a comma-separated subset of dlrm, mlp")
    if args.kill_step < 2 or args.rounds < 1:
        parser.error("--kill-step must be >= 2 (the cache saves its bundle after step 1) and --rounds >= 1")
    results: dict[str, list[dict[str, dict]]] = {m: [] for m in models}
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="compile-restart-") as d:
        for r in range(args.rounds):  # models alternate within a round: drift on a shared machine hits both alike
            for m in models:
                results[m].append(one_job(m, Path(d) / f"{m}-{r}", args.kill_step))
                print(f"round {r + 1}/{args.rounds} {m}: " + ", ".join(
                    f"{arm} {results[m][-1][arm]['s']:.2f}s" for arm in ARMS), flush=True)
    for m in models:
        report(m, results[m])
    print(f"\n(goal: first restart <= 0.25 of cold; {time.time() - began:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
