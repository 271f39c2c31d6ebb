"""An MLP with one FP8-sensitive layer, planted: what FP8Probe is for.

Run (1 CPU process, ~15 s; the probe's table and "FP8-safe and eligible: …" at the end,
``ett_runs/fp8-outliers/fp8_probe.json``)::

    python examples/fp8_outliers.py fit

The regression target depends on 60 well-scaled input features. Four more input features are
huge (~1e5) and carry nothing — an un-normalized id, a timestamp, "massive activations": the
first layer's weights for them are held at zero. In full precision that layer ignores them; in
FP8 with one scale per tensor (or per row) their amax sets the scale, and the 60 useful
features are crushed into FP8's subnormals or flushed to zero. The other layers see ordinary
activations. ``planted`` and ``wide`` (64 → 1040) are large enough for torchao's tensorwise
FP8 kernels; ``mid`` (1040 → 64) and ``head`` are not.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_ett import FP8Probe

FEATURES, OUTLIERS, HIDDEN = 64, 4, 1040


class OutlierBatches(IterableDataset):
    """Batches made from (seed, rank, index): the same stream after a restart, a different one per rank."""

    def __init__(self, batch_size: int, outlier_scale: float, seed: int, rank: int, noise: float = 0.1) -> None:
        self.batch_size, self.outlier_scale, self.seed, self.rank, self.noise = batch_size, outlier_scale, seed, rank, noise
        with torch.random.fork_rng():  # the teacher is the same in every process; the global RNG is left as it was
            torch.manual_seed(1234)
            self.teacher = nn.Sequential(nn.Linear(FEATURES - OUTLIERS, 32), nn.Tanh(), nn.Linear(32, 1))

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed + 1_000_003 * self.rank + index)
        signal = torch.randn(self.batch_size, FEATURES - OUTLIERS, generator=g)
        magnitude = 1 + 0.1 * torch.randn(self.batch_size, OUTLIERS, generator=g)
        outliers = self.outlier_scale * magnitude * torch.sign(torch.randn(self.batch_size, OUTLIERS, generator=g))
        with torch.no_grad():
            target = self.teacher(signal) + self.noise * torch.randn(self.batch_size, 1, generator=g)
        return torch.cat([signal, outliers], dim=1), target

    def __iter__(self):  # type: ignore[no-untyped-def]
        index = 0
        while True:
            yield self.batch(index)
            index += 1


class OutlierData(LightningDataModule):
    def __init__(self, batch_size: int = 256, outlier_scale: float = 1e5, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank if self.trainer else 0
        hp = self.hparams
        return DataLoader(OutlierBatches(hp.batch_size, hp.outlier_scale, hp.seed, rank), batch_size=None)


class OutlierMLP(LightningModule):
    """planted (64 → 1040, sees the outliers) → mid (1040 → 64) → wide (64 → 1040) → head (1040 → 1)."""

    def __init__(self, learning_rate: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        with torch.random.fork_rng():  # the same initial weights in every run and process
            torch.manual_seed(1)
            self.planted = nn.Linear(FEATURES, HIDDEN)
            self.mid = nn.Linear(HIDDEN, 64)
            self.wide = nn.Linear(64, HIDDEN)
            self.head = nn.Linear(HIDDEN, 1)
        ignored = torch.arange(FEATURES - OUTLIERS, FEATURES)
        with torch.no_grad():
            self.planted.weight[:, ignored] = 0
        self.planted.weight.register_hook(lambda grad: grad.index_fill(1, ignored, 0))  # they stay zero
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.planted(x))
        x = torch.relu(self.mid(x))
        x = torch.relu(self.wide(x))
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(float(loss.detach()))
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


def main() -> None:
    LightningCLI(OutlierMLP, OutlierData, save_config_kwargs={"overwrite": True}, trainer_defaults={
        "accelerator": "cpu", "devices": 1, "max_steps": 3000, "logger": False, "enable_checkpointing": False,
        "default_root_dir": "ett_runs/fp8-outliers",  # fp8_probe.json goes here (or into the ETT run dir)
        "callbacks": [FP8Probe()]})  # its defaults


if __name__ == "__main__":
    main()
