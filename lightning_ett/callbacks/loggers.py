"""How the callbacks speak to Lightning's loggers: numbers to every logger, the ETT breakdown to W&B.

The W&B part imports wandb only when a ``WandbLogger`` is attached, so the monitor works without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_ett.instrument.summary import Summary


def log_to_loggers(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Log ``metrics`` at the current global step to every logger, from global rank zero only.

    Straight to the loggers rather than ``LightningModule.log``: these are process facts
    (compile counts, checkpoint timings), not per-step results to be reduced or aggregated.
    """
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


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
    experiment.log(payload)
    experiment.summary.update(
        {"ett/percent": summary.ett_percent, "ett/wall_s": summary.wall_s, "ett/lost_s": summary.lost_s,
         "ett/attempts": len(summary.attempts)}
    )
