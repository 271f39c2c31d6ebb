"""One start-up measurement: a 2-rank ETTStrategy job with a large table set (see startup_overlap.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch.utils.data import DataLoader
from torchrec.datasets.random import RandomRecDataset
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lightning_ett import ETTMonitor, ETTStrategy


class ManyTables(LightningModule):
    def __init__(self, tables: int, rows: int) -> None:
        super().__init__()
        self.tables, self.rows = tables, rows
        self.model: DLRM | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return  # idempotent: ETTStrategy calls it inside the overlap window, Lightning again later
        configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=self.rows, feature_names=[f"f{i}"])
                   for i in range(self.tables)]
        self.model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=configs, device=torch.device("meta")),
                          dense_in_features=13, dense_arch_layer_sizes=[512, 256, 16], over_arch_layer_sizes=[512, 256, 1])

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adagrad(self.parameters(), lr=0.01)


class WarmData(LightningDataModule):
    def __init__(self, tables: int, rows: int, batches: int) -> None:
        super().__init__()
        self.tables, self.rows, self.batches = tables, rows, batches
        self.dataset: RandomRecDataset | None = None

    def setup_overlapped(self) -> None:
        """ETTStrategy's hook: open the dataset while the process group forms."""
        self._open()

    def _open(self) -> None:
        if self.dataset is None:
            self.dataset = RandomRecDataset(keys=[f"f{i}" for i in range(self.tables)], batch_size=256, hash_size=self.rows,
                                            ids_per_feature=2, num_dense=13, num_generated_batches=self.batches,
                                            manual_seed=int(os.environ.get("LOCAL_RANK", "0")))

    def train_dataloader(self) -> DataLoader:
        self._open()
        return DataLoader(self.dataset, batch_size=None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--overlap", type=int, choices=[0, 1], required=True)
    p.add_argument("--tables", type=int, default=150)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--plan-cache", default=None)
    args = p.parse_args()
    out = Path(args.out)
    strategy = ETTStrategy(overlap_startup=bool(args.overlap), plan_cache_dir=args.plan_cache)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy,
                      max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[ETTMonitor(run_dir=out / "ett", report_on_end=False)])
    fit_called = time.time()
    trainer.fit(ManyTables(args.tables, args.rows), WarmData(args.tables, args.rows, args.batches))
    (out / f"fit_called_rank{trainer.global_rank}.json").write_text(json.dumps({"fit_called": fit_called}))


if __name__ == "__main__":
    main()
