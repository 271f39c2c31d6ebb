"""End-to-end ETT% on identical training: the pack vs the same training without it, and vanilla Lightning.

    .venv/bin/python benchmarks/e2e_ett.py [--job user|dlrm|long] [--rounds R] [--steps N --every K --kill-at S]

Each job runs to its last step across injected failures (rank 1 SIGKILLed after a chosen step,
``LIGHTNING_ETT_FAULT_KILL``, before that step's checkpoint callbacks run) and is restarted.
Arms (#31):

* **vanilla**: stock Lightning, ``strategy="ddp"`` (the tables as dense DDP parameters, the
  job's own optimizer for everything), a synchronous ``ModelCheckpoint`` writing one file per
  save (``save_top_k=1, save_last="link"``), ``fit(ckpt_path="last")``; started by ``torchrun
  --standalone`` and started again by this script at once when it failed (a zero restart gap,
  which flatters it).
* **same-training**: what the pack trains, without its ETT machinery: the same ``ETTStrategy``
  (sharded tables, fused row-wise Adagrad), under ``torchrun`` and this script's restart like
  vanilla, the same synchronous ``ModelCheckpoint`` (one sharded DCP write per save), no other
  pack callback. **Headline: pack overhead / same-training overhead** (goal <= 0.33).
* **pack**: ``lightning run`` + ``ETTStrategy`` + ``ETTMonitor`` + ``AsyncCheckpoint`` (keeping
  one checkpoint, the baselines' retention) (+ ``CompileCache``, DLRM; not ``DynamicShapes``: the
  batches are all one size and the other arms compile without it, so the work stays identical).
* **same-training A/A**: the same-training arm again, in the same round: its ratio to
  same-training is the noise floor; a difference inside it is reported as none.

vanilla / same-training is the strategy's training-speed gain (ETTStrategy vs DDP), not ETT.

Jobs:

* ``--job user`` (e2e_user_job.py; 300 steps, a checkpoint every 15, rank 1 killed after step 180,
  3 rounds): three 100,000 x 32 tables, an MLP, ``Adam(self.parameters())``, batch 256, no
  compile, an offline WandbLogger in every arm. Each job has its own default inductor directory.
* ``--job dlrm`` (e2e_job.py; 600 steps, every 100, kill after 350, 3 rounds): the example DLRM
  (26 tables x 20,000 x 16, batch 512, dense parts compiled). Each arm runs a **first job** and
  then a **recurring job** of the same model on the same host: the recurring job keeps the
  inductor directory (and, pack, the CompileCache directory) its first job left.
* ``--job long`` (the user job, ~10 minutes of the pack's training, 3 rounds, ~85 min): a calibration run
  of same-training measures the step time and a synchronous save's cost ``C``; the job gets
  ``--minutes`` of steps and a failure every ``--failure-every-s`` seconds of training (rank 1
  killed at the same steps in the pack and same-training). same-training saves every
  ``sqrt(2 C MTBF)`` seconds (Young/Daly from the calibration, MTBF = the failure interval); the
  pack uses ``every_n_train_steps="auto"`` with the same MTBF. ``--with-vanilla`` adds vanilla on
  the same minutes of training and failure interval, from its own calibration (its steps are ~6x
  slower: the same steps would take ~1 h), at its own Young/Daly interval; ``--arms vanilla`` runs it alone.
  Goal: pack ETT >= 90 %.

Two clocks: **ledger** (each arm's ETTMonitor ledger; the torchrun arms' clock starts at this
script's first launch and ends when their last process exited, as the pack launcher's does)
and **probe** (this script's ``time.time()`` from just before the first process starts to the
last one's exit). Effective = the ledger's ``train`` in both; overhead = wall - effective.
Units of arms rotate their order from round to round; medians (min-max) over rounds, then
every run.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.reference_job import BIN, JOB, env
from benchmarks.spread import median_range, round_order
from lightning_ett.checkpoint.cadence import young_daly_interval_s
from lightning_ett.instrument.ledger import LedgerWriter, launcher_ledger_path
from lightning_ett.instrument.summary import Summary, summarize_run_dir

USER_JOB = str(HERE / "e2e_user_job.py")
DEFAULTS = {  # per job: --steps, --every, --kill-at, --rounds
    "dlrm": {"steps": 600, "every": 100, "kill_at": 350, "rounds": 3},
    "user": {"steps": 300, "every": 15, "kill_at": 180, "rounds": 3},
}
GOAL = 0.33  # pack overhead / same-training overhead
LONG_GOAL = 90.0  # pack ETT% on the long job
BASE, AA = "same-training", "same-training A/A"
#: The long job's arms, in the order :func:`long_units` builds them (its run directories are numbered so).
LONG_ARMS = ("vanilla", BASE, "pack", AA)


@dataclass
class Result:
    summary: Summary  # from the ledger
    probe_wall_s: float  # this script's clock: first process started -> last process exited

    @property
    def overhead_s(self) -> float:
        return self.summary.wall_s - self.summary.effective_s

    @property
    def probe_overhead_s(self) -> float:
        return self.probe_wall_s - self.summary.effective_s

    @property
    def probe_ett_percent(self) -> float:
        return 100.0 * self.summary.effective_s / self.probe_wall_s

    @property
    def lost_steps(self) -> int:
        """Steps run again after a failure: an attempt's last step back to where the next one resumed."""
        attempts = self.summary.attempts
        return sum(max(0, a.last_step - b.first_step + 1) for a, b in itertools.pairwise(attempts)
                   if a.last_step is not None and b.first_step is not None)


@dataclass(frozen=True)
class Job:
    """How to start one job of one arm: the script, its arguments, and the injected failures."""

    script: str
    args: list[str]
    kill: str  # LIGHTNING_ETT_FAULT_KILL
    failures: int  # how many the kill spec causes: the job must restart that often

    def environ(self, inductor: Path, **extra: str) -> dict[str, str]:
        """Every arm: W&B offline, the given default inductor directory, the same rendezvous setting."""
        return env(inductor, LIGHTNING_ETT_FAULT_KILL=self.kill, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **extra)


def write_end(run_dir: Path) -> None:
    """The job ends when its last process has exited, as under the pack's launcher."""
    writer = LedgerWriter(launcher_ledger_path(run_dir, 0))
    writer.append({"kind": "end", "time": time.time(), "exitcode": 0, "reason": "finished"})
    writer.close()


def launch(cmd: list[str], environ: dict[str, str], log: Path) -> int:
    """Start a launcher, output to ``log``; its exit code."""
    with open(log, "w") as out:
        return subprocess.run(cmd, env=environ, stdout=out, stderr=subprocess.STDOUT, timeout=7200, check=False).returncode


def failed(what: str, log: Path, rc: int) -> RuntimeError:
    return RuntimeError(f"{what} exited {rc}; the end of {log}:\n{log.read_text()[-4000:]}")


def run_torchrun(work: Path, job: Job, arm: str, inductor: Path) -> Result:
    """``torchrun``, started again at once after each failure until the job ends: the operator's restart."""
    work.mkdir(parents=True)
    extra = ["--resume"] if job.script == JOB else []  # the DLRM job resumes only when asked
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", job.script, "--arm", arm, "--work",
           str(work), *job.args, *extra]
    started = time.time()
    environ = job.environ(inductor, LIGHTNING_ETT_JOB_START=repr(started))
    for attempt in range(job.failures + 1):
        log = work / f"attempt{attempt}.log"
        rc = launch(cmd, environ, log)
        if (rc != 0) != (attempt < job.failures):
            raise failed(f"{arm} attempt {attempt} ({job.failures} SIGKILL(s) were injected)", log, rc)
    probe = time.time() - started
    write_end(work / "run")
    return Result(summarize_run_dir(work / "run"), probe)


def run_lightning(work: Path, job: Job, inductor: Path, compile_cache: Path | None = None,
                  arm: str = "pack") -> Result:
    """``lightning run --max-restarts F`` of ``arm`` (the pack; same-training to time the launcher alone)."""
    work.mkdir(parents=True)
    extra = ["--compile-cache", str(compile_cache)] if compile_cache is not None else []
    cmd = [str(BIN / "lightning"), "run", "--devices", "2", "--max-restarts", str(job.failures), "--run-dir",
           str(work / "run"), job.script, "--arm", arm, "--work", str(work), *job.args, *extra]
    started = time.time()
    rc = launch(cmd, job.environ(inductor), work / "launcher.log")
    probe = time.time() - started
    if rc != 0:
        raise failed(f"{arm} (lightning run)", work / "launcher.log", rc)
    summary = summarize_run_dir(work / "run")
    if len(summary.attempts) != job.failures + 1:
        raise failed(f"{arm} (lightning run) with {len(summary.attempts)} attempt(s), not {job.failures + 1}",
                     work / "launcher.log", rc)
    return Result(summary, probe)


# ---------------------------------------------------------------------------- arms, in units that run together
Unit = list[tuple[str, Callable[[Path], Result]]]  # (arm name, run in a work dir); a unit's jobs share its host state


def torchrun_unit(name: str, arm: str, job: Job, recurring: bool) -> Unit:
    """One job of ``arm`` (and, ``recurring``, a second job on the first one's inductor directory)."""
    if not recurring:
        return [(name, lambda d: run_torchrun(d / "job", job, arm, d / "inductor"))]
    return [(f"{name}, first job", lambda d: run_torchrun(d / "first", job, arm, d / "inductor")),
            (f"{name}, recurring job", lambda d: run_torchrun(d / "recurring", job, arm, d / "inductor"))]


def pack_unit(job: Job, recurring: bool) -> Unit:
    if not recurring:
        return [("pack", lambda d: run_lightning(d / "job", job, d / "inductor"))]
    return [("pack, first job", lambda d: run_lightning(d / "first", job, d / "inductor", d / "compile_cache")),
            ("pack, recurring job", lambda d: run_lightning(d / "recurring", job, d / "inductor", d / "compile_cache"))]


def three_arms(job: Job, recurring: bool, with_vanilla: bool = True) -> list[Unit]:
    units = [torchrun_unit(BASE, "same", job, recurring), pack_unit(job, recurring),
             torchrun_unit(AA, "same", job, recurring)]
    return ([torchrun_unit("vanilla", "vanilla", job, recurring)] if with_vanilla else []) + units


def run_rounds(tmp: Path, units: list[Unit], rounds: int) -> dict[str, list[Result]]:
    """Every unit once a round, the order rotated by one each round; results by arm in the units' order."""
    arms: dict[str, list[Result]] = {name: [] for unit in units for name, _ in unit}
    for r in range(rounds):
        t = time.time()
        order = round_order(units, r)
        done = []
        for u, unit in enumerate(order):
            for name, run in unit:
                result = run(tmp / f"r{r}" / f"u{units.index(unit)}")
                arms[name].append(result)
                done.append(f"{name} {result.overhead_s:.1f}s")
        print(f"round {r} ({' -> '.join(unit[0][0] for unit in order)}): overhead (ledger) " + ", ".join(done)
              + f" [{time.time() - t:.0f}s]", flush=True)
    return arms


# ---------------------------------------------------------------------------- the long job
def calibrate(tmp: Path, arm: str = "same", every: int = 50, steps: int = 400) -> tuple[float, float]:
    """``arm`` without failures: (seconds per step, blocking seconds per synchronous save)."""
    job = Job(USER_JOB, ["--steps", str(steps), "--every", str(every), "--batches-per-epoch", "1000"], "", 0)
    s = run_torchrun(tmp / f"calibrate-{arm}", job, arm, tmp / f"calibrate-{arm}-inductor").summary
    return s.effective_s / steps, s.phases.get("checkpoint_save", 0.0) / (steps // every)


def long_schedule(step_s: float, save_s: float, minutes: float, failure_every_s: float) -> tuple[list[str], str, int, int]:
    """From a calibration: the job's arguments, its kill spec, the number of failures and the Young/Daly interval."""
    steps = round(minutes * 60 / step_s)
    kills = [round(i * failure_every_s / step_s) for i in range(1, 1 + int(minutes * 60 // failure_every_s))]
    kills = [k for k in kills if k < steps]
    every = max(1, round(young_daly_interval_s(save_s, failure_every_s) / step_s))
    data = ["--steps", str(steps), "--batches-per-epoch", "1000"]  # epochs of ~20 s, not a new one every 2 s
    return data, ",".join(f"1:{k}:{i}" for i, k in enumerate(kills)), len(kills), every


def long_units(tmp: Path, minutes: float, failure_every_s: float, with_vanilla: bool) -> list[Unit]:
    """same-training, the pack and same-training again (A/A) on the same steps and failures; vanilla (~6x slower
    steps) on the same minutes of training and failure interval, from its own calibration (the same steps would
    take ~1 h)."""
    step_s, save_s = calibrate(tmp)
    data, spec, failures, every = long_schedule(step_s, save_s, minutes, failure_every_s)
    print(f"calibration (same-training, 400 steps): step {step_s * 1e3:.1f} ms, synchronous save {save_s:.3f} s -> "
          f"{data[1]} steps, rank 1 killed ({spec}); same-training saves every {every} steps (Young/Daly, MTBF "
          f"{failure_every_s:g} s); pack: 'auto' with the same MTBF", flush=True)
    fixed = Job(USER_JOB, [*data, "--every", str(every)], spec, failures)
    auto = Job(USER_JOB, [*data, "--every", "auto", "--mtbf-hours", repr(failure_every_s / 3600)], spec, failures)
    units = [torchrun_unit(BASE, "same", fixed, False), pack_unit(auto, False), torchrun_unit(AA, "same", fixed, False)]
    if not with_vanilla:
        return units
    v_step_s, v_save_s = calibrate(tmp, "vanilla")
    v_data, v_spec, v_failures, v_every = long_schedule(v_step_s, v_save_s, minutes, failure_every_s)
    print(f"calibration (vanilla, 400 steps): step {v_step_s * 1e3:.1f} ms, synchronous save {v_save_s:.3f} s -> "
          f"{v_data[1]} steps, rank 1 killed ({v_spec}); saves every {v_every} steps (Young/Daly)", flush=True)
    return [torchrun_unit("vanilla", "vanilla", Job(USER_JOB, [*v_data, "--every", str(v_every)], v_spec, v_failures),
                          False), *units]


# ---------------------------------------------------------------------------- printing
def print_table(arms: dict[str, list[Result]], rounds: int) -> None:
    from lightning_ett.instrument.timeline import PHASE_NAMES

    names = list(arms)
    width = max(16, *(len(n) + 2 for n in names), 14 + (18 if rounds > 1 else 0))

    def row(label: str, fn: Callable[[Result], float], fmt: str = ".2f") -> None:
        print(f"{label:<34}" + "".join(f"{median_range([fn(x) for x in arms[n]], fmt):>{width}}" for n in names))

    print(f"{'seconds (mean over ranks)':<34}" + "".join(f"{n:>{width}}" for n in names))
    for phase in PHASE_NAMES:
        if max(x.summary.phases.get(phase, 0.0) for n in names for x in arms[n]) >= 0.005:
            row(phase, lambda x, p=phase: x.summary.phases.get(p, 0.0))
    print("-" * (34 + width * len(names)))
    row("lost steps (re-run)", lambda x: x.lost_steps, ".0f")
    row("effective (train)", lambda x: x.summary.effective_s)
    row("wall, ledger", lambda x: x.summary.wall_s)
    row("wall, probe", lambda x: x.probe_wall_s)
    row("overhead, ledger (wall - train)", lambda x: x.overhead_s)
    row("overhead, probe", lambda x: x.probe_overhead_s)
    row("ETT %, ledger", lambda x: x.summary.ett_percent, ".1f")
    row("ETT %, probe", lambda x: x.probe_ett_percent, ".1f")
    row("attempts", lambda x: len(x.summary.attempts), ".0f")
    print(f"(medians of {rounds} round(s){' (min-max)' if rounds > 1 else ''}; effective = the ledger's `train` in both "
          "clocks)")


def ratios(arms: dict[str, list[Result]], name: str, base: str, clock: str) -> list[float]:
    """Per round (the arms of a round ran back to back): ``name``'s overhead over ``base``'s."""
    over: Callable[[Result], float] = (lambda x: x.overhead_s) if clock == "ledger" else (lambda x: x.probe_overhead_s)
    return [over(x) / over(b) for x, b in zip(arms[name], arms[base])]


def print_ratios(arms: dict[str, list[Result]], suffix: str = "", training_speed: bool = True) -> None:
    """The headline (pack / same-training) against the A/A floor, and vanilla / same-training apart from it."""
    base, aa, pack = BASE + suffix, AA + suffix, "pack" + suffix
    for clock in ("ledger", "probe"):
        floor = ratios(arms, aa, base, clock) if aa in arms else []
        for name in (pack, aa, "vanilla" + suffix):
            if name in arms:
                print(f"overhead {name} / {base} ({clock}): {median_range(ratios(arms, name, base, clock), '.3f')}")
        headline = statistics.median(ratios(arms, pack, base, clock))
        noise = max((abs(1 - f) for f in floor), default=0.0)
        verdict = "met" if headline <= GOAL else "NOT met"
        within = " (inside the A/A floor: no difference shown)" if abs(1 - headline) <= noise else ""
        print(f"goal{suffix or ''}: pack overhead <= {GOAL} x same-training ({clock} clock): {headline:.3f} -> "
              f"{verdict}{within}; A/A floor +-{noise:.3f}")
    if training_speed and "vanilla" + suffix in arms:
        train = [v.summary.effective_s / s.summary.effective_s for v, s in zip(arms["vanilla" + suffix], arms[base])]
        print(f"training speed, vanilla (DDP) train s / same-training train s: {median_range(train, '.2f')} "
              "(the strategy's gain, not ETT)")


def print_runs(arms: dict[str, list[Result]]) -> None:
    for name, results in arms.items():
        print(f"every run, {name}: " + "; ".join(
            f"wall {x.summary.wall_s:.2f}/{x.probe_wall_s:.2f}s train {x.summary.effective_s:.2f}s "
            f"overhead {x.overhead_s:.2f}/{x.probe_overhead_s:.2f}s ETT {x.summary.ett_percent:.1f}% lost "
            f"{x.lost_steps} steps" for x in results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", choices=["user", "dlrm", "long"], default="user")
    p.add_argument("--steps", type=int, default=None, help="default: dlrm 600, user 300")
    p.add_argument("--every", type=int, default=None, help="checkpoint interval in steps; default: dlrm 100, user 15")
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL rank 1 after this step; default: dlrm 350, user 180")
    p.add_argument("--rounds", type=int, default=None, help="default: 3")
    p.add_argument("--minutes", type=float, default=10.0, help="long: minutes of the pack's training")
    p.add_argument("--failure-every-s", type=float, default=150.0, help="long: seconds of training between failures")
    p.add_argument("--with-vanilla", action="store_true", help="long: add vanilla (~11 min more a round)")
    p.add_argument("--keep", default=None, help="keep the runs (logs, ledgers) under DIR")
    p.add_argument("--arms", default=None, help="long: run only these arms (comma-separated names, e.g. vanilla)")
    args = p.parse_args()

    with contextlib.ExitStack() as stack:
        if args.keep:
            tmp = Path(args.keep)
            tmp.mkdir(parents=True)
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if args.job == "long":
            wanted = set(args.arms.split(",")) if args.arms else None
            unknown = sorted((wanted or set()) - set(LONG_ARMS))
            if unknown:
                p.error(f"--arms: unknown arm(s) {', '.join(unknown)}; the long job's: {', '.join(LONG_ARMS)}")
            rounds = args.rounds or 3
            print(f"== job long: the user job, ~{args.minutes:g} min of training, a failure every "
                  f"{args.failure_every_s:g} s, {rounds} round(s)", flush=True)
            units = long_units(tmp, args.minutes, args.failure_every_s, args.with_vanilla or "vanilla" in (wanted or ()))
            if wanted:  # e.g. vanilla alone, in a run of its own (its ETT % is a share of its own wall)
                units = [u for u in units if u[0][0] in wanted]
            arms = run_rounds(tmp, units, rounds)
            print_table(arms, rounds)
            print_runs(arms)
            for name, results in arms.items():
                ett = statistics.median(x.summary.ett_percent for x in results)
                goal = f" (goal >= {LONG_GOAL:g}: {'met' if ett >= LONG_GOAL else 'NOT met'})" if name == "pack" else ""
                print(f"long job ETT %, {name}: {ett:.1f}{goal}")
            if "pack" in arms and BASE in arms:
                print_ratios(arms, training_speed=False)  # vanilla ran other steps: no like-for-like speed ratio
            return
        cfg = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in DEFAULTS[args.job].items()}
        dlrm_only = ["--no-dynamic-shapes"] if args.job == "dlrm" else []  # identical compiled work in every arm
        job = Job(JOB if args.job == "dlrm" else USER_JOB,
                  ["--steps", str(cfg["steps"]), "--every", str(cfg["every"]), *dlrm_only],
                  f"1:{cfg['kill_at']}:0", int(cfg["kill_at"] < cfg["steps"]))
        print(f"== job {args.job}: {cfg['steps']} steps, a checkpoint every {cfg['every']}, rank 1 SIGKILLed after step "
              f"{cfg['kill_at']} of attempt 0, {cfg['rounds']} round(s)", flush=True)
        recurring = args.job == "dlrm"
        arms = run_rounds(tmp, three_arms(job, recurring), cfg["rounds"])
        print_table(arms, cfg["rounds"])
        print_runs(arms)
        for suffix in ([", first job", ", recurring job"] if recurring else [""]):
            print_ratios(arms, suffix)


if __name__ == "__main__":
    main()
