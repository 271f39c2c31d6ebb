"""Time to the first finished training step of a compiled job: its cold start, then its first and second restart.

    .venv/bin/python benchmarks/compile_restart.py [--rounds 3] [--models dlrm,mlp] [--kill-step 3]

Each model runs as one job of three attempts (1 CPU process): its worker is SIGKILLed after step
``--kill-step`` of attempts 0 and 1 (``LIGHTNING_ETT_FAULT_KILL``), and attempt 2 trains to the
end. Models:

* ``dlrm``: the example DLRM, compiled as CompileCache(compile_module=True) does (``module.compile()``);
* ``mlp``: a user's own LightningModule, an MLP with ``self.net = torch.compile(...)``, trained
  on batches of four sizes with DynamicShapes() (in every arm).

Scenarios and arms (#31):

* **same host** — one ``lightning run --max-restarts 2`` (its forkserver keeps torch, Lightning
  and TorchRec imported across attempts), one default inductor directory for all attempts and
  the machine's ``/tmp`` (inductor's precompiled header) kept:
  * ``CompileCache``: with ``CompileCache(cache_dir=...)``;
  * ``control``: the same job without CompileCache (inductor's own on-disk caches only);
  * ``control A/A``: the control again, the noise floor.
* **fresh host** — each attempt is a new ``lightning run --max-restarts 0`` into the job's run
  directory (a relaunch continues the job), with an empty ``TMPDIR`` (so an empty
  ``torchinductor_<user>``) and an empty default inductor directory; only CompileCache's
  directory carries over:
  * ``CompileCache``.

Each attempt is timed twice, from the job's ledger and the job's own clock:

* **whole**: cold, the launcher's start -> the end of attempt 0's first training step; a restart,
  the kill (the end of the killed attempt's last step, right after which its worker SIGKILLs
  itself) -> the end of the next attempt's first step: failure detection, teardown, the new
  launcher or fork, imports, the model's build and the first step;
* **fit**: ``Trainer.fit`` called -> the end of the attempt's first step: what a compile cache
  can change. whole - fit is the same in every arm of a scenario (imports, process start).

Units (one job of one arm) rotate their order from round to round. Prints medians (min-max) over
rounds and every run: seconds, each restart's ratio to its job's cold start (goal: the first
restart's fit -> first step <= 0.25 of cold's, both scenarios), what each attempt's first step
compiled (FX-graph / AOTAutograd cache hits, C++ compiler runs), and the imports measured apart
(``python -c "import torch, lightning, torchrec"``) to say how much of a restart is imports.
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
from benchmarks.spread import median_range, round_order

ATTEMPTS = ("cold", "first restart", "second restart")
ARMS = {  # name: (host, CompileCache)
    "same-host CompileCache": ("same", True),
    "same-host control": ("same", False),
    "same-host control A/A": ("same", False),
    "fresh-host CompileCache": ("fresh", True),
}
GOAL = 0.25  # first restart's fit -> first step over cold's


def one_job(model: str, arm: str, tmp: Path, kill_step: int) -> dict[str, dict]:
    """Run one job through its cold start and two restarts; returns per-attempt seconds and first-step facts."""
    from lightning_ett.instrument.ledger import read_launcher_records, read_ledger

    host, cached = ARMS[arm]
    run_dir, out = tmp / "run", tmp / "out"
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env.update(PYTHONPATH=str(HERE.parent), TORCHINDUCTOR_CACHE_DIR=str(tmp / "default-launcher"),
               LIGHTNING_ETT_FAULT_KILL=f"0:{kill_step}:0,0:{kill_step}:1")
    job = [str(HERE / "compile_restart_job.py"), "--model", model, "--host", host, "--cache-dir",
           str(tmp / "compile-cache"), "--default-inductor-root", str(tmp / "default-inductor"), "--out", str(out),
           "--max-steps", str(kill_step + 2), *([] if cached else ["--no-cache"])]

    def launch(max_restarts: int, environ: dict[str, str]) -> subprocess.CompletedProcess:
        cmd = [str(Path(sys.executable).parent / "lightning"), "run", "--devices", "1", "--max-restarts",
               str(max_restarts), "--run-dir", str(run_dir), *job]
        return subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=1800, check=False)

    if host == "same":
        proc = launch(2, env)
        if proc.returncode != 0:
            raise RuntimeError(f"{model}, {arm}: `lightning run` exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    else:
        for attempt in range(3):  # a new launcher on a new host: empty TMPDIR, nothing imported
            fresh_tmp = tmp / f"host-{attempt}-tmp"
            fresh_tmp.mkdir()
            proc = launch(0, {**env, "TMPDIR": str(fresh_tmp)})
            if (proc.returncode != 0) != (attempt < 2):
                raise RuntimeError(f"{model}, {arm}: attempt {attempt}'s `lightning run` exited {proc.returncode}:\n"
                                   f"{proc.stderr[-4000:]}")
    records = read_launcher_records(run_dir)
    job_start = min(r["job_start"] for r in records if r["kind"] == "launch")
    failed = {r["attempt"] for r in records if r["kind"] == "failure"}
    ledgers = {lg.attempt: lg for lg in read_ledger(run_dir, {0})}
    steps = {a: sorted(e["end"] for e in lg.events if e["phase"] == "train") for a, lg in ledgers.items()}
    if failed != {0, 1} or sorted(steps) != [0, 1, 2] or not all(steps.values()):
        raise RuntimeError(f"{model}, {arm}: expected attempts 0 and 1 to fail after step {kill_step} and attempt 2 "
                           f"to train; failures {sorted(failed)}, attempts with steps {sorted(steps)}")
    started = [job_start, steps[0][-1], steps[1][-1]]  # launcher start, first kill, second kill
    facts = {a: json.loads((out / f"attempt-{a}.json").read_text()) for a in range(3)}

    def phase_s(a: int, *phases: str) -> float:
        return sum(e["end"] - e["start"] for e in ledgers[a].events if e["phase"] in phases)

    return {name: {"whole": steps[a][0] - started[a], "fit": facts[a]["first_step_end"] - facts[a]["fit_start"],
                   "imports": phase_s(a, "import"), **facts[a]} for a, name in enumerate(ATTEMPTS)}


def import_seconds() -> float:
    """A fresh interpreter's ``import torch, lightning, torchrec`` (what a new process pays before anything else)."""
    began = time.time()
    subprocess.run([sys.executable, "-c", "import torch, lightning, torchrec"], check=True, capture_output=True)
    return time.time() - began


def report(model: str, results: dict[str, list[dict[str, dict]]]) -> None:
    print(f"\n{model}: seconds to the end of the first training step, medians (min-max) over {len(results[ARMS_RUN[0]])} "
          "rounds; ratios to the same job's cold start")
    print(f"  {'arm':<26}{'attempt':<16}{'whole s':>20}{'fit s':>20}{'whole / cold':>22}{'fit / cold fit':>22}"
          f"{'fx h/m':>8}{'aot h/m':>8}{'C++':>5}")
    for arm in ARMS_RUN:
        for attempt in ATTEMPTS:
            xs = [job[attempt] for job in results[arm]]

            def med(key: str, xs: list[dict] = xs) -> float:
                return statistics.median(x[key] for x in xs)

            whole = [job[attempt]["whole"] / job["cold"]["whole"] for job in results[arm]]
            fit = [job[attempt]["fit"] / job["cold"]["fit"] for job in results[arm]]
            print(f"  {arm:<26}{attempt:<16}{median_range([x['whole'] for x in xs]):>20}"
                  f"{median_range([x['fit'] for x in xs]):>20}{median_range(whole, '.3f'):>22}{median_range(fit, '.3f'):>22}"
                  f"{med('compile/fx_cache_hits'):>5.0f}/{med('compile/fx_cache_misses'):<2.0f}"
                  f"{med('compile/aot_cache_hits'):>5.0f}/{med('compile/aot_cache_misses'):<2.0f}"
                  f"{med('compile/cpp_compiles'):>5.0f}")
    for arm in ARMS_RUN:
        print(f"  every run, {arm}: " + "; ".join(
            "/".join(f"{job[a]['whole']:.2f}({job[a]['fit']:.2f})" for a in ATTEMPTS) for job in results[arm])
            + "   [whole(fit) s: cold/first/second]")
    for arm in ARMS_RUN:
        if arm.endswith("CompileCache"):
            ratio = statistics.median(job["first restart"]["fit"] / job["cold"]["fit"] for job in results[arm])
            print(f"  goal, {arm}: first restart fit -> first step <= {GOAL} x cold: {ratio:.3f} -> "
                  f"{'met' if ratio <= GOAL else 'NOT met'}")
    control = {a: [job["first restart"]["fit"] for job in results.get(a, [])] for a in ("same-host control",
                                                                                          "same-host control A/A")}
    if all(control.values()) and "same-host CompileCache" in results:
        aa = [x / y for x, y in zip(control["same-host control A/A"], control["same-host control"])]
        cache = [job["first restart"]["fit"] / c for job, c in zip(results["same-host CompileCache"],
                                                                     control["same-host control"])]
        noise = max(abs(1 - r) for r in aa)
        verdict = "inside the A/A floor: no difference shown" if abs(1 - statistics.median(cache)) <= noise else \
            "outside the A/A floor"
        print(f"  same host, first restart fit s, CompileCache / control: {median_range(cache, '.3f')}; A/A "
              f"{median_range(aa, '.3f')} -> {verdict}")


ARMS_RUN: list[str] = list(ARMS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="dlrm,mlp", help="comma-separated: dlrm, mlp")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
    parser.add_argument("--kill-step", type=int, default=3, help="SIGKILL attempts 0 and 1 after this step (>= 2)")
    parser.add_argument("--json", default=None, help="also write every round's figures to this file")
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not set(models) <= {"dlrm", "mlp"} or not models:
        parser.error(f"--models {args.models!r}: expected a comma-separated subset of dlrm, mlp")
    ARMS_RUN[:] = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not set(ARMS_RUN) <= set(ARMS) or not ARMS_RUN:
        parser.error(f"--arms {args.arms!r}: expected a comma-separated subset of {', '.join(ARMS)}")
    if args.kill_step < 2 or args.rounds < 1:
        parser.error("--kill-step must be >= 2 (the cache saves its bundle after step 1) and --rounds >= 1")
    results: dict[str, dict[str, list[dict[str, dict]]]] = {m: {a: [] for a in ARMS_RUN} for m in models}
    imports: list[float] = []
    began = time.time()
    units: list[tuple[str, str]] = [(m, a) for m in models for a in ARMS_RUN]
    with tempfile.TemporaryDirectory(prefix="compile-restart-") as d:
        for r in range(args.rounds):
            imports.append(import_seconds())
            order = round_order(units, r)
            for m, a in order:
                slug = a.replace(" ", "_").replace("/", "")
                results[m][a].append(one_job(m, a, Path(d) / f"{m}-{r}-{slug}", args.kill_step))
                job = results[m][a][-1]
                print(f"round {r + 1}/{args.rounds} {m}, {a}: " + ", ".join(
                    f"{x} {job[x]['whole']:.2f}s (fit {job[x]['fit']:.2f}s)" for x in ATTEMPTS), flush=True)
    for m in models:
        report(m, results[m])
    print(f"\nimports measured apart (python -c 'import torch, lightning, torchrec'): {median_range(imports)} s")
    print(f"(goal: first restart fit -> first step <= {GOAL} of cold's, both scenarios; {time.time() - began:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
