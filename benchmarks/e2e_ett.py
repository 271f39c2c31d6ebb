"""End-to-end ETT% of a reference job: the pack vs vanilla Lightning, one injected SIGKILL each.

    .venv/bin/python benchmarks/e2e_ett.py [--job dlrm|user|both] [--steps N --every K --kill-at S] [--rounds R]

Two reference jobs, each run to its last step across one failure: rank 1 is SIGKILLed after
step ``--kill-at`` of the first attempt (``LIGHTNING_ETT_FAULT_KILL=1:S:0``) and the job is
restarted once.

``--job dlrm`` (benchmarks/e2e_job.py; defaults ``--steps 600 --every 100 --kill-at 350 --rounds 1``):
the example TorchRec DLRM (26 tables x 20,000 x 16) on 2 CPU ranks (gloo), batch 512, the dense
parts compiled with torch.compile. Both arms keep inductor's default cache directory on the same
host across the job's attempts (the pack's CompileCache directory too).

* **vanilla**: stock Lightning (DDP, synchronous ``ModelCheckpoint(save_top_k=1, save_last="link")``:
  one write per save), started by ``torchrun --standalone`` and started again at once by this
  script when it failed, resuming from ``last.ckpt``.
* **pack, first job**: ``lightning run --max-restarts 1`` + ETTStrategy + ETTMonitor +
  AsyncCheckpoint + CompileCache + DynamicShapes, with an empty compile cache.
* **pack, recurring job**: the same, with the compile cache a previous job of this model left
  (what a retraining pipeline has from its second run on).

``--job user`` (benchmarks/e2e_user_job.py; defaults ``--steps 300 --every 15 --kill-at 180 --rounds 3``):
what a new user writes: three 100,000 x 32 tables, an MLP, ``Adam(self.parameters())``,
batch 256, no compile, an offline WandbLogger in both arms; one default inductor directory per
job, shared by its attempts (same host), in both arms.

* **vanilla**: ``strategy="ddp"``, a synchronous ``ModelCheckpoint`` writing one file per save
  (``save_top_k=1``, ``save_last="link"``), ``fit(ckpt_path="last")``; started by
  ``torchrun --standalone --nproc-per-node 2`` and, once torchrun exits non-zero, started again
  by this script at once (the operator's restart, with a zero gap that flatters vanilla).
* **pack**: ``lightning run --devices 2 --max-restarts 1`` + ``ETTStrategy()`` (defaults) +
  ``ETTMonitor`` + ``AsyncCheckpoint(every_n_train_steps=K)``.

Within a job, the arms get the same environment (W&B offline, the inductor policy above; user
job: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which ``lightning run`` sets anyway) and alternate
their order from round to round. Two clocks:

* **ledger**: the ETTMonitor ledger (vanilla: ``ETTMonitor(run_dir=...)`` only measures; its job
  clock starts at this script's first launch and ends when its last process exited, as the pack
  launcher's does);
* **probe**: this script's own clock from just before the first process is started to the
  last one's exit, the same for both arms; effective time (``train``) comes from the ledger.

Prints per arm the phase breakdown, wall, effective, overhead (= wall - effective), ETT% and
overhead / vanilla overhead: medians over rounds with the spread (min-max).
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
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.reference_job import BIN, JOB, env, run_pack
from benchmarks.spread import median_range
from lightning_ett.instrument.ledger import LedgerWriter, launcher_ledger_path
from lightning_ett.instrument.summary import Summary, summarize_run_dir

USER_JOB = str(HERE / "e2e_user_job.py")
DEFAULTS = {  # per job: --steps, --every, --kill-at, --rounds
    "dlrm": {"steps": 600, "every": 100, "kill_at": 350, "rounds": 1},
    "user": {"steps": 300, "every": 15, "kill_at": 180, "rounds": 3},
}
GOAL = 0.25  # pack overhead / vanilla overhead


@dataclass
class Result:
    summary: Summary  # from the ledger
    probe_wall_s: float  # this script's clock: first process started -> last process exited

    @property
    def probe_overhead_s(self) -> float:
        return self.probe_wall_s - self.summary.effective_s

    @property
    def probe_ett_percent(self) -> float:
        return 100.0 * self.summary.effective_s / self.probe_wall_s


def write_end(run_dir: Path) -> None:
    """The job ends when its last process has exited, as under the pack's launcher."""
    writer = LedgerWriter(launcher_ledger_path(run_dir, 0))
    writer.append({"kind": "end", "time": time.time(), "exitcode": 0, "reason": "finished"})
    writer.close()


def launch(cmd: list[str], environ: dict[str, str], log: Path) -> int:
    """Start a launcher, output to ``log``; its exit code."""
    with open(log, "w") as out:
        return subprocess.run(cmd, env=environ, stdout=out, stderr=subprocess.STDOUT, timeout=3600, check=False).returncode


def failed(what: str, log: Path, rc: int) -> RuntimeError:
    return RuntimeError(f"{what} exited {rc}; the end of {log}:\n{log.read_text()[-4000:]}")


# ---------------------------------------------------------------------------- the DLRM job
def dlrm_vanilla(work: Path, job: list[str], kill: str) -> Result:
    """torchrun, then the same command once it failed (resuming from ``last.ckpt``): the operator's restart."""
    return vanilla_torchrun(work, JOB, [*job, "--resume"], kill, expect_failure=True)


def dlrm_pack(work: Path, job: list[str], kill: str, compile_cache: Path) -> Result:
    started = time.time()
    run_dir = run_pack(work, job, compile_cache, max_restarts=1, LIGHTNING_ETT_FAULT_KILL=kill)
    return Result(summarize_run_dir(run_dir), time.time() - started)


def dlrm_round(tmp: Path, r: int, job: list[str], kill: str) -> dict[str, Result]:
    out: dict[str, Result] = {}
    cache = tmp / f"compile_cache{r}"

    def packs() -> None:
        out["pack, first job"] = dlrm_pack(tmp / f"p{r}", job, kill, cache)
        # The cache the job above left is what the next job of this model starts with.
        out["pack, recurring job"] = dlrm_pack(tmp / f"q{r}", job, kill, cache)

    if r % 2 == 0:
        out["vanilla"] = dlrm_vanilla(tmp / f"v{r}", job, kill)
        packs()
    else:
        packs()
        out["vanilla"] = dlrm_vanilla(tmp / f"v{r}", job, kill)
    return out


# ---------------------------------------------------------------------------- the user job
def job_env(work: Path, kill: str, **extra: str) -> dict[str, str]:
    """Both arms: one default inductor directory for the job's attempts (same host)."""
    return env(work / "inductor", LIGHTNING_ETT_FAULT_KILL=kill, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **extra)


def user_vanilla(work: Path, job: list[str], kill: str, expect_failure: bool) -> Result:
    return vanilla_torchrun(work, USER_JOB, job, kill, expect_failure)


def vanilla_torchrun(work: Path, script: str, job: list[str], kill: str, expect_failure: bool) -> Result:
    """``torchrun``, then the same command again once it failed: the operator's restart (at once)."""
    work.mkdir(parents=True)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", script, "--arm", "vanilla", "--work",
           str(work), *job]
    started = time.time()
    environ = job_env(work, kill, LIGHTNING_ETT_JOB_START=repr(started))
    rc = launch(cmd, environ, work / "attempt0.log")
    if expect_failure != (rc != 0):
        raise failed("vanilla attempt 0 (a SIGKILL was expected)" if expect_failure else "vanilla", work / "attempt0.log", rc)
    if rc != 0:
        rc = launch(cmd, environ, work / "attempt1.log")
        if rc != 0:
            raise failed("vanilla attempt 1", work / "attempt1.log", rc)
    probe = time.time() - started
    write_end(work / "run")
    return Result(summarize_run_dir(work / "run"), probe)


def user_pack(work: Path, job: list[str], kill: str, expect_failure: bool) -> Result:
    work.mkdir(parents=True)
    cmd = [str(BIN / "lightning"), "run", "--devices", "2", "--max-restarts", "1", "--run-dir", str(work / "run"),
           USER_JOB, "--arm", "pack", "--work", str(work), *job]
    environ = job_env(work, kill)
    started = time.time()
    rc = launch(cmd, environ, work / "launcher.log")
    probe = time.time() - started
    if rc != 0:
        raise failed("pack (lightning run)", work / "launcher.log", rc)
    summary = summarize_run_dir(work / "run")
    if expect_failure and len(summary.attempts) < 2:
        raise failed("pack (lightning run) without the expected restart", work / "launcher.log", rc)
    return Result(summary, probe)


def user_round(tmp: Path, r: int, job: list[str], kill: str, expect_failure: bool) -> dict[str, Result]:
    arms: dict[str, Callable[[], Result]] = {
        "vanilla": lambda: user_vanilla(tmp / f"v{r}", job, kill, expect_failure),
        "pack": lambda: user_pack(tmp / f"p{r}", job, kill, expect_failure),
    }
    order = list(arms) if r % 2 == 0 else list(reversed(arms))
    out = {name: arms[name]() for name in order}
    return {name: out[name] for name in arms}  # columns in a fixed order


# ---------------------------------------------------------------------------- printing
def print_table(arms: dict[str, list[Result]], rounds: int) -> None:
    from lightning_ett.instrument.timeline import PHASE_NAMES

    names = list(arms)
    width = max(22, *(len(n) + 2 for n in names), 14 + (18 if rounds > 1 else 0))

    def row(label: str, fn: Callable[[Result], float], fmt: str = ".2f") -> None:
        print(f"{label:<34}" + "".join(f"{median_range([fn(x) for x in arms[n]], fmt):>{width}}" for n in names))

    print(f"{'seconds (mean over ranks)':<34}" + "".join(f"{n:>{width}}" for n in names))
    for phase in PHASE_NAMES:
        if max(x.summary.phases.get(phase, 0.0) for n in names for x in arms[n]) >= 0.005:
            row(phase, lambda x, p=phase: x.summary.phases.get(p, 0.0))
    print("-" * (34 + width * len(names)))
    row("effective (train)", lambda x: x.summary.effective_s)
    row("wall, ledger", lambda x: x.summary.wall_s)
    row("wall, probe", lambda x: x.probe_wall_s)
    row("overhead, ledger (wall - train)", lambda x: x.summary.wall_s - x.summary.effective_s)
    row("overhead, probe", lambda x: x.probe_overhead_s)
    row("ETT %, ledger", lambda x: x.summary.ett_percent, ".1f")
    row("ETT %, probe", lambda x: x.probe_ett_percent, ".1f")
    row("attempts", lambda x: len(x.summary.attempts), ".0f")
    base = arms["vanilla"]
    for clock, over in (("ledger", lambda x: x.summary.wall_s - x.summary.effective_s),
                        ("probe", lambda x: x.probe_overhead_s)):
        # per round (arms of one round ran back to back), then the median over rounds
        ratios = {n: [over(x) / over(v) for x, v in zip(arms[n], base)] for n in names}
        print(f"{'overhead / vanilla, ' + clock:<34}" + "".join(f"{median_range(ratios[n], '.3f'):>{width}}" for n in names))
    spread = " (min-max)" if rounds > 1 else ""
    print(f"(medians of {rounds} round(s){spread}; arms alternate their order from round to round; "
          f"effective = the ledger's `train` in both clocks)")
    for n in names[1:]:
        for clock, over in (("ledger", lambda x: x.summary.wall_s - x.summary.effective_s),
                            ("probe", lambda x: x.probe_overhead_s)):
            ratio = statistics.median([over(x) / over(v) for x, v in zip(arms[n], base)])
            verdict = "met" if ratio <= GOAL else "NOT met"
            print(f"goal: {n} overhead <= {GOAL} x vanilla ({clock} clock): {ratio:.3f} -> {verdict}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", choices=["dlrm", "user", "both"], default="dlrm")
    p.add_argument("--steps", type=int, default=None, help="default: dlrm 600, user 300")
    p.add_argument("--every", type=int, default=None, help="checkpoint interval in steps; default: dlrm 100, user 15")
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL rank 1 after this step; default: dlrm 350, user 180")
    p.add_argument("--rounds", type=int, default=None, help="default: dlrm 1, user 3")
    p.add_argument("--keep", default=None, help="keep the runs (logs, ledgers) under DIR/JOB")
    args = p.parse_args()

    for name in ["dlrm", "user"] if args.job == "both" else [args.job]:
        cfg = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in DEFAULTS[name].items()}
        job = ["--steps", str(cfg["steps"]), "--every", str(cfg["every"])]
        kill = f"1:{cfg['kill_at']}:0"
        print(f"== job {name}: {cfg['steps']} steps, a checkpoint every {cfg['every']}, rank 1 SIGKILLed after step "
              f"{cfg['kill_at']} of attempt 0, {cfg['rounds']} round(s)", flush=True)
        arms: dict[str, list[Result]] = {}
        with contextlib.ExitStack() as stack:
            if args.keep:
                tmp = Path(args.keep) / name
                tmp.mkdir(parents=True)
            else:
                tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            for r in range(cfg["rounds"]):
                t = time.time()
                if name == "dlrm":
                    results = dlrm_round(tmp, r, job, kill)
                else:
                    results = user_round(tmp, r, job, kill, expect_failure=cfg["kill_at"] < cfg["steps"])
                for arm, result in results.items():
                    arms.setdefault(arm, []).append(result)
                print(f"round {r}: " + ", ".join(f"{a} overhead {x.probe_overhead_s:.1f}s (probe)" for a, x in results.items())
                      + f" [{time.time() - t:.0f}s]", flush=True)
        print_table(arms, cfg["rounds"])


if __name__ == "__main__":
    main()
