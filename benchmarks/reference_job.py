"""Starting the reference job (e2e_job.py) from the end-to-end benchmarks: environment, launcher command.

Shared by e2e_ett.py, cadence.py and publish_cost.py so that all three measure the same job
started the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "e2e_job.py")
BIN = Path(sys.executable).parent


def env(inductor_dir: Path, **extra: str) -> dict[str, str]:
    """This process's environment without job identity, W&B offline, inductor's default cache at ``inductor_dir``."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    e.update(PYTHONPATH=str(HERE.parent), WANDB_MODE="offline", TORCHINDUCTOR_CACHE_DIR=str(inductor_dir), **extra)
    return e


def run(cmd: list[str], environ: dict[str, str], expect_ok: bool = True) -> None:
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=3600, check=False)
    if expect_ok and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def run_pack(work: Path, job_args: list[str], compile_cache: Path, max_restarts: int, **extra_env: str) -> Path:
    """``lightning run`` of the pack arm on 2 ranks; returns the job's run directory."""
    cmd = [str(BIN / "lightning"), "run", "--devices", "2", "--max-restarts", str(max_restarts), "--run-dir",
           str(work / "run"), JOB, "--arm", "pack", "--work", str(work), "--compile-cache", str(compile_cache), *job_args]
    run(cmd, env(work / "inductor", **extra_env))
    return work / "run"
