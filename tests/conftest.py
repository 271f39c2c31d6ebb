from __future__ import annotations

import atexit
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from helpers.zygote import DISABLE as ZYGOTE_OFF
from helpers.zygote import Zygote

from lightning_ett.instrument import timeline

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture(autouse=True)
def isolated_job(monkeypatch: pytest.MonkeyPatch) -> timeline.Timeline:
    """Each test is its own job: no LIGHTNING_ETT_* leaks between tests, a fresh timeline, and the
    environment restored afterwards (a Trainer run in this process sets MASTER_PORT, LOCAL_RANK...:
    a later job started from here would take itself for an already-launched rank and wait for peers)."""
    saved = dict(os.environ)
    for key in list(os.environ):
        if key.startswith("LIGHTNING_ETT_"):
            monkeypatch.delenv(key)
    fresh = timeline.Timeline()
    monkeypatch.setattr(timeline, "_TIMELINE", fresh)
    yield fresh
    fresh.close()
    os.environ.clear()
    os.environ.update(saved)


def clean_env(**extra: str) -> dict[str, str]:
    return _job_env(os.environ, extra)


def _job_env(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith("LIGHTNING_ETT_")}
    env.update({"PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}, **extra)
    return env


# scikit-learn sets these two at import (sklearn/__init__.py), and tests/test_tune_search.py imports it while
# being collected: set them first, so the zygote's environment and every job's agree whatever was imported.
os.environ.setdefault("KMP_DUPLICATE_LIB_OK", "True")
os.environ.setdefault("KMP_INIT_AT_FORK", "FALSE")
#: The environment before any test ran: the zygote's, so that a job differs from it only in what the job sets.
_SESSION_ENV = dict(os.environ)
_ZYGOTE: list[Zygote] = []


def session_zygote() -> Zygote:
    """The session's preloaded interpreter (:mod:`helpers.zygote`)."""
    if not _ZYGOTE:
        _ZYGOTE.append(Zygote(_job_env(_SESSION_ENV, {})))
        atexit.register(_ZYGOTE[0].close)
    return _ZYGOTE[0]


def run_script(*args: str, timeout: float = 240, cwd: Path | None = None, fresh: bool = False,
               **env: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` with the test environment: a script is forked from the session's zygote when nothing in its
    environment needs a fresh interpreter (see :mod:`helpers.zygote`), else started as a real process.

    ``fresh=True``: always a real process, for a test whose subject is the start itself (the import phase, the
    process's start time as the OS records it, what each rank's start costs).
    """
    job_env = clean_env(**env)
    if not fresh and os.environ.get(ZYGOTE_OFF) != "1" and session_zygote().serves(args, job_env):
        return session_zygote().run(args, job_env, cwd, timeout)
    return subprocess.run(
        [sys.executable, *args], check=False, env=job_env, capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def devices_in(script_args: tuple[str, ...], default: int) -> int:
    """The ``--devices N`` a test script is given (its own default otherwise), for the launcher to match."""
    return int(script_args[script_args.index("--devices") + 1]) if "--devices" in script_args else default


def rank_facts(out: Path) -> list[dict]:
    """What each rank of a test script saved as ``OUT/rank<N>.pt``, in rank order."""
    import torch

    return [torch.load(f, weights_only=False) for f in sorted(out.glob("rank*.pt"))]


#: The ``lightning`` command installed beside this interpreter (the README's ``lightning run``).
LIGHTNING = str(Path(sys.executable).parent / "lightning")


def lightning_run(*args: str, timeout: float = 300, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """``lightning run ARGS``: workers' output arrives on its stdout/stderr, each line prefixed ``[default<rank>]:``."""
    return subprocess.run([LIGHTNING, "run", *args], env=clean_env(**env), check=False, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def launch(script: str, *args: str, run_dir: Path, devices: int = 2, max_restarts: int = 0, timeout: float = 300,
           cwd: Path | None = None, flags: tuple[str, ...] | list[str] = (), **env: str) -> subprocess.CompletedProcess[str]:
    """A job started as the README starts one, without restarts unless asked: for tests of what a job does rather
    than of how it was started.

    A multi-rank start costs less this way than as ``python SCRIPT`` (~5 s instead of ~9 s for 2 ranks here):
    the ranks fork from one preloaded interpreter instead of each importing torch, Lightning and TorchRec in turn.
    ``flags`` are the launcher's own (``--hang-timeout ...``).
    """
    return lightning_run("--devices", str(devices), "--max-restarts", str(max_restarts), "--run-dir", str(run_dir), *flags,
                         script, *args, timeout=timeout, cwd=cwd, **env)


@pytest.fixture(scope="session")
def uninterrupted_dlrm(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """The 2-rank sharded DLRM job (tests/scripts/ett_job.py defaults: table-wise, dense Adam) trained 12 steps
    without interruption, with a synchronous checkpoint at step 6: the reference several tests compare against.

    Checkpointing and step sleeps change nothing in what is trained, so one run serves them all (each 2-rank
    start costs ~7 s here). Returns each rank's facts and the checkpoint directory; copy it before changing it.
    """
    out = tmp_path_factory.mktemp("uninterrupted-dlrm")
    proc = launch(str(SCRIPTS / "ett_job.py"), "--out", str(out), "--max-steps", "12", "--save-every", "6",
                  "--ckpt-dir", str(out / "ckpt"), run_dir=out / "ett")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return rank_facts(out), out / "ckpt"


# ---------------------------------------------------------------------------------------------- the checkout stays clean
_OWN_LEFTOVERS = ("__pycache__", ".pytest_cache", ".venv/")  # what running Python and pytest itself leaves


def _checkout_state() -> set[str]:
    """Every path git reports as changed, untracked or ignored in the checkout (none: not a git checkout)."""
    proc = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--ignored"], cwd=REPO,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return set()
    return {line for line in proc.stdout.splitlines() if not any(part in line for part in _OWN_LEFTOVERS)}


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_CHECKOUT_KEY] = _checkout_state()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Every test writes under its own temporary directory: a file the suite left in the checkout fails it."""
    before = session.config.stash.get(_CHECKOUT_KEY, None)
    if before is None:
        return
    left = sorted(_checkout_state() - before)
    if left:
        session.config.get_terminal_writer().line(f"the test suite changed the checkout: {left}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_CHECKOUT_KEY = pytest.StashKey[set]()
