"""Job identity that survives restarts: run directory, job id, job start, attempt.

A launcher (``lightning run``) stamps these into the environment before it starts the
workers; a user can set them by hand; otherwise the first process of a job picks them and
exports them so that the ranks Lightning spawns for it inherit the same values.
"""

from __future__ import annotations

import os
import re
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ENV_RUN_DIR = "LIGHTNING_ETT_RUN_DIR"
ENV_JOB_ID = "LIGHTNING_ETT_JOB_ID"
ENV_JOB_START = "LIGHTNING_ETT_JOB_START"
ENV_ATTEMPT = "LIGHTNING_ETT_ATTEMPT"
ENV_ATTEMPT_START = "LIGHTNING_ETT_ATTEMPT_START"
ENV_LAUNCHER = "LIGHTNING_ETT_LAUNCHER"

DEFAULT_RUNS_ROOT = "ett_runs"

_imported_at: float | None = None


def mark_imported() -> None:
    """Called once ``lightning_ett`` (and so Lightning and torch) finished importing."""
    global _imported_at
    if _imported_at is None:
        _imported_at = time.time()


def import_time() -> float:
    """End of the ``import`` phase: when ``lightning_ett`` finished importing."""
    return _imported_at if _imported_at is not None else time.time()


def process_start_time() -> float:
    """Wall-clock time at which the OS created this process.

    Linux exposes the start in clock ticks since boot; pairing it with ``CLOCK_BOOTTIME``
    gives ~10 ms precision (``psutil`` pairs it with the integer boot time: ±1 s). Elsewhere
    the import time of this package is the best lower-effort bound.
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5); two fields precede the ")" split
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_boot
    except (OSError, ValueError, IndexError, AttributeError):
        return import_time()


def env_rank() -> int:
    """Global rank as the launchers tell it before any process group exists."""
    for key in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def _new_job_id() -> str:
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(key, "")
        if value and value != "none":
            return re.sub(r"[^A-Za-z0-9_.-]", "_", value)
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def count_attempts(run_dir: Path, rank: int) -> int:
    """Attempts this rank already ran in ``run_dir``: the next attempt's number."""
    from lightning_ett.ledger import rank_ledger_files

    return len(rank_ledger_files(run_dir, rank))


@dataclass(frozen=True)
class JobContext:
    """Where this process's events go and which job and attempt they belong to."""

    run_dir: Path
    job_id: str
    job_start: float
    attempt: int
    attempt_start: float
    process_start: float


def resolve_job_context(run_dir: str | os.PathLike | None = None, export: bool = True) -> JobContext:
    """Resolve the job identity from arguments and the environment, and export it.

    Exporting makes the ranks that Lightning's launcher spawns from this process join the
    same job and attempt instead of starting their own.
    """
    process_start = process_start_time()
    job_id = os.environ.get(ENV_JOB_ID) or _new_job_id()
    if run_dir is None:
        run_dir = os.environ.get(ENV_RUN_DIR) or os.path.join(os.getcwd(), DEFAULT_RUNS_ROOT, job_id)
    path = Path(run_dir).expanduser().absolute()
    job_start = float(os.environ.get(ENV_JOB_START, process_start))
    job_start = min(job_start, process_start)
    if ENV_ATTEMPT in os.environ:
        attempt = int(os.environ[ENV_ATTEMPT])
    else:
        attempt = count_attempts(path, env_rank())
    attempt_start = min(float(os.environ.get(ENV_ATTEMPT_START, process_start)), process_start)
    if export:
        os.environ[ENV_RUN_DIR] = str(path)
        os.environ[ENV_JOB_ID] = job_id
        os.environ[ENV_JOB_START] = repr(job_start)
        os.environ[ENV_ATTEMPT] = str(attempt)
        os.environ[ENV_ATTEMPT_START] = repr(attempt_start)
    return JobContext(path, job_id, job_start, attempt, attempt_start, process_start)


def wandb_available() -> bool:
    """Whether ``wandb`` can be imported, without importing it (it costs ~1 s)."""
    if "wandb" in sys.modules:
        return sys.modules["wandb"] is not None
    import importlib.util

    return importlib.util.find_spec("wandb") is not None
