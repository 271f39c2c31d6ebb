"""One rank with DataLoader worker processes, AsyncCheckpoint and ETTMonitor, training until it is stopped."""

from __future__ import annotations

import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, Dataset

from lightning_ett import AsyncCheckpoint, ETTMonitor


class Endless(Dataset):
    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randn(32)


class SlowSteps(BoringModel):
    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        time.sleep(0.05)
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Endless(), batch_size=4, num_workers=2)


if __name__ == "__main__":
    out = sys.argv[1]
    pl.Trainer(accelerator="cpu", devices=1, max_steps=100000, logger=False, enable_progress_bar=False,
               enable_model_summary=False, default_root_dir=out,
               callbacks=[ETTMonitor(), AsyncCheckpoint(dirpath=f"{out}/ckpt", every_n_train_steps=100000)]).fit(SlowSteps())
