"""Trials: one real ``lightning run`` of the script per configuration, and the log that makes a tune resumable.

A trial runs ``SCRIPT [SCRIPT_ARGS] <its options> --trainer.max_steps M --trainer.devices D``
under ``lightning run --max-restarts 0`` in a directory of its own, which is also its working
directory: relative paths in the user's config (checkpoint, plan-cache and log directories)
land in the trial's directory, so trials never resume from or overwrite one another. (Paths
among SCRIPT_ARGS that exist are made absolute first; absolute paths in the config are shared:
give such a config relative ones.) A trial that fails — an invalid combination, an OOM, a
timeout — is a result with its reason, not the tuner's failure.

``trials.json`` is rewritten atomically after every trial: a tune interrupted and run again
with the same ``--out`` skips the configurations it holds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_ett.durable.files import atomic_write_text
from lightning_ett.tune.measure import measure
from lightning_ett.tune.space import Config, cli_arguments, key

TRIALS_FILE = "trials.json"


@dataclass
class Trial:
    index: int
    config: Config
    round: int
    outcome: str  # "ok" or "failed"
    objective: float | None = None
    reason: str | None = None
    measurements: dict[str, Any] = field(default_factory=dict)
    run_dir: str | None = None
    seconds: float = 0.0
    predicted: float | None = None  # the proxy's prediction when it chose this trial (None: not chosen by the proxy)
    repeat: int = 0  # 0: the configuration's first run; 1, 2, ...: its confirmation runs

    @property
    def key(self) -> str:
        return key(self.config)


class TrialLog:
    """``DIR/trials.json``: every trial, in the order it ran."""

    def __init__(self, out: Path) -> None:
        self.path = out / TRIALS_FILE
        self.trials: list[Trial] = []
        if self.path.exists():
            try:
                raw = json.loads(self.path.read_text())
                self.trials = [Trial(**t) for t in raw["trials"]]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{str(self.path)!r} is not a trials file this tuner wrote ({err}); move it away or "
                                 "give another --out.") from err

    def done(self) -> dict[str, Trial]:
        return {t.key: t for t in self.trials}

    def add(self, trial: Trial, header: dict[str, Any]) -> None:
        self.trials.append(trial)
        atomic_write_text(self.path, json.dumps({**header, "trials": [asdict(t) for t in self.trials]}, indent=2,
                                                default=str) + "\n")


@dataclass(frozen=True)
class TrialRunner:
    """How to run one configuration of the user's script for real."""

    script: Path
    script_args: list[str]
    steps: int
    devices: int
    out: Path
    timeout_s: float = 1800.0

    def trial_dir(self, index: int) -> Path:
        return self.out / f"trial-{index:03d}"

    def command(self, config: Config) -> list[str]:
        return [sys.executable, "-m", "lightning_ett.launch.cli", "run", "--devices", str(self.devices),
                "--max-restarts", "0", "--run-dir", "run", str(self.script), *self.script_args, *cli_arguments(config),
                "--trainer.max_steps", str(self.steps), "--trainer.devices", str(self.devices)]

    def __call__(self, index: int, config: Config) -> tuple[str | None, dict[str, Any], float, str]:
        """Run it; returns (failure reason or None, measurements, seconds, run dir)."""
        where = self.trial_dir(index)
        shutil.rmtree(where, ignore_errors=True)  # an earlier, interrupted run of this trial
        where.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
        env.setdefault("WANDB_MODE", "offline")
        start = time.perf_counter()
        with open(where / "trial.log", "w") as log:
            try:
                proc = subprocess.run(self.command(config), cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=self.timeout_s, check=False)
                code: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
        seconds = time.perf_counter() - start
        m = measure(where / "run", self.steps)
        if code is None:
            return f"timed out after {self.timeout_s:.0f} s", m.to_dict(), seconds, str(where)
        if not m.ok or code != 0:
            reason = m.reason or f"lightning run exited with {code}"
            return reason + ("" if m.phases else f" (see {where / 'trial.log'})"), m.to_dict(), seconds, str(where)
        return None, m.to_dict(), seconds, str(where)


def absolute_paths(args: list[str], cwd: Path) -> list[str]:
    """SCRIPT_ARGS with every token that names an existing file or directory made absolute (trials run elsewhere)."""
    out = []
    for arg in args:
        name, eq, value = arg.partition("=")
        candidate = value if eq else arg
        path = cwd / candidate
        if candidate and not candidate.startswith("-") and path.exists():
            out.append(f"{name}={path.resolve()}" if eq else str(path.resolve()))
        else:
            out.append(arg)
    return out
