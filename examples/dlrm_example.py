"""TorchRec DLRM on synthetic Criteo-shaped data, trained with Lightning and measured by ETTMonitor.

Run (2 CPU processes, W&B offline unless WANDB_API_KEY is set)::

    lightning run --devices 2 examples/dlrm_example.py fit --config examples/dlrm.yaml

or without the launcher (no restarts)::

    python examples/dlrm_example.py fit --config examples/dlrm.yaml

Every ``__init__`` argument below is a LightningCLI option (``--model.embedding_dim 32``).
"""

from __future__ import annotations

import os

import torch
import torchmetrics
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.random import RandomRecDataset
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from lightning_ett import record_phase


class NormalizedEntropy(torchmetrics.Metric):
    """Binary cross-entropy divided by the entropy of the label rate (lower is better; 1.0 = base rate).

    torchmetrics has no NE; torchrec's RecMetric NE needs its own metric module plumbing.
    """

    full_state_update = False

    def __init__(self, eps: float = 1e-7) -> None:
        super().__init__()
        self.eps = eps
        self.add_state("cross_entropy", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("positives", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        labels = labels.double()
        ce = torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels, reduction="sum")
        self.cross_entropy += ce
        self.positives += labels.sum()
        self.count += labels.numel()

    def compute(self) -> torch.Tensor:
        p = (self.positives / self.count).clamp(self.eps, 1 - self.eps)
        base = -(p * torch.log(p) + (1 - p) * torch.log(1 - p))
        return (self.cross_entropy / self.count) / base


class DLRMModule(LightningModule):
    """torchrec's DLRM: one embedding table per Criteo categorical feature, BCE loss."""

    def __init__(
        self,
        num_embeddings: int = 20_000,
        embedding_dim: int = 16,
        dense_arch_layer_sizes: list[int] = [128, 16],  # noqa: B006 - LightningCLI needs a literal default
        over_arch_layer_sizes: list[int] = [128, 64, 1],  # noqa: B006
        learning_rate: float = 0.05,
        compile_dense: bool = False,
    ) -> None:
        """``compile_dense`` compiles the dense parts (bottom MLP, interaction, top MLP) with
        ``torch.compile``; the embedding tables stay eager (TorchRec shards them)."""
        super().__init__()
        if dense_arch_layer_sizes[-1] != embedding_dim:
            raise ValueError(
                f"dense_arch_layer_sizes must end with embedding_dim={embedding_dim} (got {dense_arch_layer_sizes}): "
                "DLRM interacts the dense output with the embeddings."
            )
        self.save_hyperparameters()
        with record_phase("model_init"):
            tables = [
                EmbeddingBagConfig(name=f"t_{name}", embedding_dim=embedding_dim, num_embeddings=num_embeddings,
                                   feature_names=[name])
                for name in DEFAULT_CAT_NAMES
            ]
            self.model = DLRM(
                embedding_bag_collection=EmbeddingBagCollection(tables=tables),
                dense_in_features=len(DEFAULT_INT_NAMES),
                dense_arch_layer_sizes=dense_arch_layer_sizes,
                over_arch_layer_sizes=over_arch_layer_sizes,
            )
        if compile_dense:
            for dense_part in (self.model.dense_arch, self.model.inter_arch, self.model.over_arch):
                dense_part.compile()
        self.loss = torch.nn.BCEWithLogitsLoss()
        self.val_auroc = torchmetrics.AUROC(task="binary")
        self.val_ne = NormalizedEntropy()

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.model(batch.dense_features, batch.sparse_features).squeeze(-1)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self.loss(self(batch), batch.labels.float())
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.labels.numel())
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        logits = self(batch)
        labels = batch.labels.float()
        self.val_auroc.update(logits, batch.labels.int())
        self.val_ne.update(logits, labels)
        self.log("val/loss", self.loss(logits, labels), batch_size=labels.numel(), sync_dist=True)
        self.log("val/auroc", self.val_auroc, batch_size=labels.numel())
        self.log("val/ne", self.val_ne, batch_size=labels.numel())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.parameters(), lr=self.hparams.learning_rate)


class RandomCriteoDataModule(LightningDataModule):
    """Criteo-shaped synthetic batches (13 dense, 26 sparse features) as KeyedJaggedTensors.

    Each rank draws its own stream (seed + rank), as a sharded real dataset would.
    """

    def __init__(
        self,
        batch_size: int = 512,
        num_embeddings: int = 20_000,
        ids_per_feature: int = 2,
        num_train_batches: int = 100_000,
        num_val_batches: int = 20,
        seed: int = 0,
        num_generated_batches: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _dataset(self, num_batches: int, seed: int) -> RandomRecDataset:
        hp = self.hparams
        return RandomRecDataset(
            keys=DEFAULT_CAT_NAMES,
            batch_size=hp.batch_size,
            hash_size=hp.num_embeddings,
            ids_per_feature=hp.ids_per_feature,
            num_dense=len(DEFAULT_INT_NAMES),
            manual_seed=seed,
            num_batches=num_batches,
            num_generated_batches=hp.num_generated_batches,  # cycled; -1: every batch new (a non-repeating stream)
        )

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank if self.trainer else 0
        return DataLoader(self._dataset(self.hparams.num_train_batches, self.hparams.seed + rank), batch_size=None)

    def val_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank if self.trainer else 0
        return DataLoader(self._dataset(self.hparams.num_val_batches, self.hparams.seed + 10_000 + rank), batch_size=None)


def main() -> None:
    if not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")
    LightningCLI(DLRMModule, RandomCriteoDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
