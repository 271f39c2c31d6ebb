"""Job identity that survives restarts: run directory, job id, job start, attempt.

A launcher can stamp these into the environment before it starts the workers; a user can
set them by hand; otherwise the first process of a job picks them and exports them so that
the ranks Lightning spawns for it inherit the same values. The run directory keeps the job's
id and start in ``job.json``, so a restart into the same directory is the same job.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from lightning_ett.durable.files import atomic_write_json

ENV_RUN_DIR = "LIGHTNING_ETT_RUN_DIR"
ENV_JOB_ID = "LIGHTNING_ETT_JOB_ID"
ENV_JOB_START = "LIGHTNING_ETT_JOB_START"
ENV_ATTEMPT = "LIGHTNING_ETT_ATTEMPT"
ENV_ATTEMPT_START = "LIGHTNING_ETT_ATTEMPT_START"
ENV_EXPORTED_BY = "LIGHTNING_ETT_EXPORTED_BY"
#: Set by ``lightning run`` for its workers: the launcher owns the job-level report.
ENV_LAUNCHER = "LIGHTNING_ETT_LAUNCHER"
#: Set by ``lightning run`` when its hang watch reads the ledgers: ranks announce phase starts.
ENV_HANG_WATCH = "LIGHTNING_ETT_HANG_WATCH"
#: Set by ``lightning run``: its pid. Its forkserver and workers die with it (:mod:`lightning_ett.lifecycle.lifeline`).
ENV_LAUNCHER_PID = "LIGHTNING_ETT_LAUNCHER_PID"
#: Set by ``lightning run``: a token unique to the launch. Every process the job starts inherits it, so the
#: launcher's sweeper finds them all when the launcher dies (:mod:`lightning_ett.lifecycle.sweeper`).
ENV_LAUNCH_TOKEN = "LIGHTNING_ETT_LAUNCH_TOKEN"


def launch_scratch_dir(token: str) -> Path:
    """A launch's scratch directory on this host (the hang watch's named pipes and dumps); removed at its end."""
    return Path(tempfile.gettempdir()) / f"lightning-ett-{token}"
JOB_FILE = "job.json"

DEFAULT_RUNS_ROOT = "ett_runs"

_imported_at: float | None = None


def mark_imported() -> None:
    """Called once ``lightning_ett`` (and so Lightning and torch) finished importing."""
    global _imported_at
    if _imported_at is None:
        _imported_at = time.time()


def _forget_import_mark() -> None:
    global _imported_at
    _imported_at = None


# A worker forked from `lightning run`'s preloading server has its own `import` phase.
os.register_at_fork(after_in_child=_forget_import_mark)


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


def launched_job() -> str | None:
    """``lightning run``'s job: its id and run directory (``"<id> in <dir>"``), the same on every node and across
    relaunches into the run dir; ``None`` outside ``lightning run``. What a checkpoint's manifest records of the job
    that committed it, so a later start of the job finds the job's own checkpoints: no clock, restart counter or
    per-node value is compared. (The id alone defaults to the run dir's name, which two jobs may share.)"""
    job, run_dir = os.environ.get(ENV_JOB_ID, ""), os.environ.get(ENV_RUN_DIR, "")
    return f"{job} in {run_dir}" if ENV_LAUNCHER in os.environ and job and run_dir else None


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
    from lightning_ett.instrument.ledger import rank_ledger_files

    return len(rank_ledger_files(run_dir, rank))


def read_job_file(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_job_file(run_dir: Path, job_id: str, job_start: float) -> None:
    """Record the job's identity in its run directory once (the first attempt's values win)."""
    path = run_dir / JOB_FILE
    if path.exists():
        return
    atomic_write_json(path, {"job_id": job_id, "job_start": job_start}, indent=None)


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
    env = dict(os.environ)
    if env.get(ENV_EXPORTED_BY) == str(os.getpid()) and run_dir is not None:
        exported = env.get(ENV_RUN_DIR)
        if exported is None or Path(run_dir).expanduser().absolute() != Path(exported):
            # This process exported another job earlier (a notebook, a sweep): start a new one.
            env = {k: v for k, v in env.items() if not k.startswith("LIGHTNING_ETT_")}
    if run_dir is None and ENV_RUN_DIR in env:
        run_dir = env[ENV_RUN_DIR]
    recorded = read_job_file(Path(run_dir).expanduser().absolute()) if run_dir is not None else None
    job_id = env.get(ENV_JOB_ID) or (recorded or {}).get("job_id") or _new_job_id()
    if run_dir is None:
        run_dir = os.path.join(os.getcwd(), DEFAULT_RUNS_ROOT, job_id)
    path = Path(run_dir).expanduser().absolute()
    job_start = min(float(env.get(ENV_JOB_START, process_start)), process_start,
                    float((recorded or {}).get("job_start", process_start)))
    if ENV_ATTEMPT in env:
        attempt = int(env[ENV_ATTEMPT])
    else:
        attempt = count_attempts(path, env_rank())
    attempt_start = min(float(env.get(ENV_ATTEMPT_START, process_start)), process_start)
    if export:
        os.environ.update({
            ENV_RUN_DIR: str(path), ENV_JOB_ID: job_id, ENV_JOB_START: repr(job_start), ENV_ATTEMPT: str(attempt),
            ENV_ATTEMPT_START: repr(attempt_start), ENV_EXPORTED_BY: str(os.getpid()),
        })
    return JobContext(path, job_id, job_start, attempt, attempt_start, process_start)
