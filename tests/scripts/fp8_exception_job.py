"""FP8Probe with Lightning's OnExceptionCheckpoint on 2 ranks, where rank 0 alone raises at step 12: the exception's
save runs on rank 0 only, and must write its checkpoint rather than wait in a collective of the probe's."""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_ett import FP8Probe


class RaisesOnRankZero(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 12 and self.global_rank == 0:
            raise RuntimeError("a failure on rank 0 alone")
        return self.net(batch).pow(2).mean()

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(4096, 32), batch_size=64)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    seed_everything(0, verbose=False)
    Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=10)), max_steps=40, logger=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.out,
            callbacks=[FP8Probe(every_n_steps=2, max_overhead=0.9), OnExceptionCheckpoint(args.out, "on-exception")]
            ).fit(RaisesOnRankZero())


if __name__ == "__main__":
    main()
