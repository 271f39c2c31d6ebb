"""What the callbacks ask Lightning's fit loop that it has no public API for."""

from __future__ import annotations

import lightning.pytorch as pl


def accumulating(trainer: pl.Trainer) -> bool:
    """Is the current batch one that only accumulates gradients (its optimizer step comes with a later batch)?"""
    should_accumulate = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
    return bool(should_accumulate()) if callable(should_accumulate) else False
