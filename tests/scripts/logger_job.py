"""A 2-rank ETTStrategy job with loggers, for the start-up and W&B tests (run under `lightning run`).

``--slow-logger S`` adds a logger whose experiment takes S seconds to create (a stand-in for a
slow W&B login); ``--wandb-dir`` adds an offline ``WandbLogger``; AsyncCheckpoint saves every
``--every`` steps, so a restarted attempt resumes and re-runs the steps after the last save.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment

from lightning_ett import AsyncCheckpoint, ETTMonitor, ETTStrategy


class SlowStartLogger(Logger):
    """A logger whose experiment takes ``seconds`` to create, as a remote tracker's login does."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self._experiment: Any = None

    @property
    def name(self) -> str:
        return "slow"

    @property
    def version(self) -> int:
        return 0

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            time.sleep(self.seconds)
            self._experiment = object()
        return self._experiment

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass  # the test reads the ledger, not this logger

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--slow-logger", type=float, default=0.0)
    p.add_argument("--wandb-dir", default=None)
    args = p.parse_args()
    loggers: list[Logger] = []
    if args.slow_logger:
        loggers.append(SlowStartLogger(args.slow_logger))
    if args.wandb_dir:
        loggers.append(WandbLogger(save_dir=args.wandb_dir, offline=True, project="lightning-ett-tests"))
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=ETTStrategy(), max_steps=args.max_steps, logger=loggers or False,
        callbacks=[ETTMonitor(log_every_n_steps=2), AsyncCheckpoint(args.ckpt_dir, every_n_train_steps=args.every)],
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    trainer.fit(BoringModel())


if __name__ == "__main__":
    main()
