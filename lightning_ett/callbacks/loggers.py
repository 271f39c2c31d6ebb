"""How the callbacks speak to Lightning's loggers: numbers to every logger, the ETT breakdown to W&B.

The W&B part imports wandb only when a ``WandbLogger`` is attached, so the monitor works without it.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ett.instrument.summary import Summary

#: W&B run ids: at most 64 characters, none of ``/ \ # ? % :``; we keep to the safe ones.
_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def wandb_run_id(job_id: str, job_start: float) -> str:
    """The W&B run id of an ETT job, the same for every attempt: its job id, made safe, and a digest.

    The digest covers the job's start (kept in the run directory's ``job.json``), so two jobs
    whose run directories share a name (``lightning run --run-dir run``) never resume each other's run.
    """
    digest = hashlib.sha1(f"{job_id}@{job_start!r}".encode()).hexdigest()[:8]
    return f"{_RUN_ID_UNSAFE.sub('-', job_id)[:55]}-{digest}"


def share_wandb_run(loggers: list[Logger], job_id: str, job_start: float) -> None:
    """Make every attempt of a job write into one W&B run: the job's id, resumed.

    W&B gives each ``wandb.init`` a new random id, so a job restarted three times made four
    runs and split its ETT% chart across them. Lightning's ``WandbLogger`` already passes
    ``resume="allow"``; what it lacks is an id that every attempt shares. A user's own ``id`` or
    ``version`` wins. Called just before the experiment is created. ``WandbLogger`` reads its init
    arguments from ``_wandb_init`` and reports ``_id`` as its version; Lightning offers no
    public setter for either.
    """
    for logger in loggers:
        if not isinstance(logger, WandbLogger) or logger._wandb_init.get("id"):
            continue
        if logger._experiment is not None:
            rank_zero_warn("ETTMonitor: this WandbLogger's run was created before the Trainer started, so later "
                           "attempts of the job will not write into it. Pass `WandbLogger(id=...)` to choose the run.")
            continue
        run_id = wandb_run_id(job_id, job_start)
        logger._wandb_init["id"] = run_id
        logger._wandb_init.setdefault("resume", "allow")
        logger._id = run_id


def log_to_loggers(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Log ``metrics`` at the current global step to every logger, from global rank zero only.

    Straight to the loggers rather than ``LightningModule.log``: these are process facts
    (compile counts, checkpoint timings), not per-step results to be reduced or aggregated.
    """
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def health_metrics(summary: Summary) -> dict[str, float]:
    """The job's step-time health and straggler verdict as ``ett/*`` numbers (``ett/straggler_rank`` -1: none)."""
    metrics = {f"ett/{name}": float(value) for name, value in summary.step_health.items()
               if name not in ("steps", "clean_steps") and value is not None}
    stragglers = summary.stragglers
    if stragglers is not None:
        metrics["ett/straggler_rank"] = float(stragglers["straggler"] if stragglers["straggler"] is not None else -1)
    return metrics


def log_breakdown(experiment: Any, summary: Summary, png: Path | None) -> None:
    import wandb

    wall = summary.wall_s or 1.0
    rows = [[phase, round(seconds, 3), round(100 * seconds / wall, 2)]
            for phase, seconds in summary.phases.items() if seconds > 0]
    table = wandb.Table(columns=["phase", "seconds", "percent_of_wall"], data=rows)
    payload: dict[str, Any] = {
        "ett/phase_table": table,
        "ett/phase_breakdown": wandb.plot.bar(table, "phase", "seconds",
                                              title=f"ETT {summary.ett_percent:.1f}%: where the wall time went"),
    }
    if png is not None and png.exists():
        payload["ett/timeline"] = wandb.Image(str(png))
    stragglers = summary.stragglers
    if stragglers is not None:  # the last window's score of every rank, and how often each was named
        named = stragglers["named"]
        payload["ett/straggler_table"] = wandb.Table(
            columns=["rank", "score_s", "windows_named"],
            data=[[int(rank), score, named.get(rank, 0)] for rank, score in stragglers["latest"]["scores"].items()])
    experiment.log(payload)
    final = {f"ett/{phase}_s": seconds for phase, seconds in summary.phases.items()}
    final.update({"ett/percent": summary.ett_percent, "ett/wall_s": summary.wall_s, "ett/effective_s": summary.effective_s,
                  "ett/lost_s": summary.lost_s, "ett/attempts": len(summary.attempts), **health_metrics(summary)})
    experiment.summary.update(final)  # the job's figures, across every attempt
