"""One way for the callbacks to send numbers to every attached logger."""

from __future__ import annotations

import lightning.pytorch as pl


def log_to_loggers(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Log ``metrics`` at the current global step to every logger, from global rank zero only.

    Straight to the loggers rather than ``LightningModule.log``: these are process facts
    (compile counts, checkpoint timings), not per-step results to be reduced or aggregated.
    """
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
