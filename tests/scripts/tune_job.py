"""A LightningCLI script whose throughput depends on its knobs in a known way, for tests/test_tune.py.

Each step sleeps ``step_ms(extra_layers, width, fused)`` milliseconds (the model's "compute"),
give or take 10 % (uniform noise, drawn per step), so the fastest configuration and the order
of all of them are known in advance: throughput is the batch size over that step (more samples
per step, fewer extra layers, narrower). ``fused`` **interacts** with ``width``: it saves 14 ms at
width 64 and costs 3 ms at the others, so its effect changes sign with another option's value —
a model additive in the options (one effect per option) cannot rank these configurations.
``extra_layers=0`` with ``width=64`` is an invalid combination: the model refuses it, as a real
one might run out of memory.
"""

from __future__ import annotations

import random
import time

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset


def step_ms(extra_layers: int, width: int, fused: bool = False) -> float:
    interaction = (-14.0 if width == 64 else 3.0) if fused else 0.0
    return 8.0 + 12.0 * extra_layers + {16: 0.0, 32: 6.0, 64: 16.0}[width] + interaction


class Knobs(LightningModule):
    def __init__(self, extra_layers: int = 0, width: int = 16, fused: bool = False) -> None:
        super().__init__()
        if extra_layers == 0 and width == 64:
            raise ValueError("width=64 needs extra_layers >= 1 (this model's invalid combination)")
        self.extra_layers, self.width, self.fused = extra_layers, width, fused
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), *[torch.nn.Linear(width, width) for _ in range(extra_layers)],
                                       torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        time.sleep(step_ms(self.extra_layers, self.width, self.fused) * random.uniform(0.9, 1.1) / 1000)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Data(LightningDataModule):
    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(4096, 8, generator=g), torch.randn(4096, 1, generator=g)),
                          batch_size=self.batch_size)


if __name__ == "__main__":
    LightningCLI(Knobs, Data, trainer_defaults={"accelerator": "cpu", "logger": False, "enable_checkpointing": False,
                                                "enable_progress_bar": False, "enable_model_summary": False},
                 save_config_callback=None)
