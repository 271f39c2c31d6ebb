"""Does the pack slow the long job's steps? The user job without failures, identical steps, four arms.

    .venv/bin/python benchmarks/long_step_check.py STEPS ROUNDS WORK_DIR

``e2e_ett.py --job long`` scores ETT% with each arm's own ``train`` seconds, so a pack whose steps were
slower would look better than it is. Here each arm trains STEPS steps of the user job (e2e_user_job.py)
with no failure injected: same-training under torchrun and under ``lightning run`` (the launcher alone),
the pack saving every 276 steps and the pack with ``"auto"`` (MTBF 150 s); the arms' order rotates by
one each round. Printed per run: ``train`` seconds and milliseconds per step from the ledger.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.e2e_ett import BIN, USER_JOB, Job, launch, run_lightning, run_torchrun
from lightning_ett.instrument.summary import Summary, summarize_run_dir


def main() -> None:
    steps, rounds, tmp = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    data = ["--steps", str(steps), "--batches-per-epoch", "1000"]
    fixed = Job(USER_JOB, [*data, "--every", "276"], "", 0)
    auto = Job(USER_JOB, [*data, "--every", "auto", "--mtbf-hours", repr(150 / 3600)], "", 0)

    def same_under_lightning(d: Path) -> Summary:
        d.mkdir(parents=True)
        cmd = [str(BIN / "lightning"), "run", "--devices", "2", "--max-restarts", "0", "--run-dir", str(d / "lrun"),
               USER_JOB, "--arm", "same", "--work", str(d), *fixed.args]
        rc = launch(cmd, fixed.environ(d / "inductor"), d / "launcher.log")
        if rc != 0:
            raise RuntimeError(f"same-training under lightning run exited {rc}; see {d / 'launcher.log'}")
        return summarize_run_dir(d / "run")

    arms = {"same/torchrun": lambda d: run_torchrun(d, fixed, "same", d.parent / (d.name + "-inductor")).summary,
            "same/lightning run": same_under_lightning,
            "pack every 276": lambda d: run_lightning(d, fixed, d.parent / (d.name + "-inductor")).summary,
            "pack auto": lambda d: run_lightning(d, auto, d.parent / (d.name + "-inductor")).summary}
    names = list(arms)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            s = arms[name](tmp / f"r{r}" / name.replace("/", "_").replace(" ", "_"))
            print(f"round {r} {name:20s} train {s.effective_s:.2f}s  {1e3 * s.effective_s / steps:.2f} ms/step  "
                  f"save {s.phases.get('checkpoint_save', 0.0):.2f}s wall {s.wall_s:.1f}s", flush=True)


if __name__ == "__main__":
    main()
