"""The W&B view of a job's ETT: a phase table, a bar chart and the timeline PNG in the run.

Imported only when a ``WandbLogger`` is attached, so the monitor works without wandb.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_ett.summary import Summary


def log_breakdown(experiment: Any, summary: Summary, png: Path | None) -> None:
    import wandb

    wall = summary.wall_s or 1.0
    rows = [[phase, round(seconds, 3), round(100 * seconds / wall, 2)] for phase, seconds in summary.phases.items() if seconds > 0]
    table = wandb.Table(columns=["phase", "seconds", "percent_of_wall"], data=rows)
    payload: dict[str, Any] = {
        "ett/phase_table": table,
        "ett/phase_breakdown": wandb.plot.bar(table, "phase", "seconds", title=f"ETT {summary.ett_percent:.1f}%: where the wall time went"),
    }
    if png is not None and png.exists():
        payload["ett/timeline"] = wandb.Image(str(png))
    experiment.log(payload)
    experiment.summary.update(
        {"ett/percent": summary.ett_percent, "ett/wall_s": summary.wall_s, "ett/lost_s": summary.lost_s, "ett/attempts": len(summary.attempts)}
    )
