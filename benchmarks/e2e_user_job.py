"""One attempt of the user-style reference job for e2e_ett.py (``--job user``) and launch_start.py.

What a new TorchRec user writes, nothing tuned: three ``EmbeddingBagCollection`` tables of
100,000 x 32 (one feature each, 4 ids per sample), a small dense MLP over-arch on the pooled
embeddings and 16 dense features, ``torch.optim.Adam(self.parameters())``, batch 256, a random
in-memory data set (one fixed seed; Lightning's distributed sampler gives each rank its
deterministic share), eager mode only (no graph capture), an offline ``WandbLogger``.

* ``--arm pack``: ``ETTStrategy()`` with its defaults (tables sharded, fused row-wise Adagrad for
  them; Adam keeps the dense part), ``ETTMonitor(report_on_end=False)``,
  ``AsyncCheckpoint(WORK/ckpt, every_n_train_steps=K, keep_last_n=1)`` (the baselines' retention; resumes
  by itself). Started by
  ``lightning run``, which restarts it.
* ``--arm vanilla``: ``strategy="ddp"``, a synchronous ``ModelCheckpoint`` that writes one file per
  save (``save_top_k=1`` with no monitor keeps only the newest, ``save_last="link"`` points
  ``last.ckpt`` at it instead of writing it again), ``fit(ckpt_path="last")`` (a first launch
  starts from scratch, a relaunch resumes). Started by ``torchrun``; relaunched by hand.
  ``ETTMonitor(run_dir=WORK/run)`` only measures.
* ``--arm same``: same training as the pack, none of its ETT machinery: ``ETTStrategy()`` (its
  defaults, as the pack) under ``torchrun``, the vanilla arm's synchronous ``ModelCheckpoint``
  (one sharded DCP write per save), ``fit(ckpt_path="last")``, ``ETTMonitor(run_dir=...)`` only
  measures. The pack's overhead divided by this arm's is what the pack's ETT machinery removes.
  (``long_step_check.py`` also starts it under ``lightning run``, to time the launcher alone.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_ett import AsyncCheckpoint, ETTMonitor, ETTStrategy

FEATURES = ("user_id", "item_id", "category_id")
NUM_EMBEDDINGS = 100_000
EMBEDDING_DIM = 32
IDS_PER_SAMPLE = 4
NUM_DENSE = 16
BATCH_SIZE = 256


class UserModel(LightningModule):
    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=EMBEDDING_DIM, num_embeddings=NUM_EMBEDDINGS, feature_names=[f])
            for f in FEATURES
        ])
        self.over_arch = nn.Sequential(
            nn.Linear(NUM_DENSE + len(FEATURES) * EMBEDDING_DIM, 128), nn.ReLU(),
            nn.Linear(128, 64), nn.ReLU(),
            nn.Linear(64, 1),
        )
        self.loss = nn.BCEWithLogitsLoss()

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        batch = ids.shape[0]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=list(FEATURES),
            values=ids.transpose(0, 1).reshape(-1),  # feature-major: all of feature 0, then feature 1, ...
            lengths=torch.full((len(FEATURES) * batch,), IDS_PER_SAMPLE, dtype=torch.int32),
        )
        pooled = self.ebc(kjt).values()  # [batch, features * dim]
        return self.over_arch(torch.cat([dense, pooled], dim=1)).squeeze(-1)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        dense, ids, labels = batch
        loss = self.loss(self(dense, ids), labels)
        self.log("train/loss", loss, batch_size=labels.numel())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def random_dataset(num_samples: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(num_samples, NUM_DENSE, generator=g)
    ids = torch.randint(0, NUM_EMBEDDINGS, (num_samples, len(FEATURES), IDS_PER_SAMPLE), generator=g)
    labels = (torch.rand(num_samples, generator=g) < 0.25).float()
    return TensorDataset(dense, ids, labels)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arm", choices=["pack", "same", "vanilla"], required=True)
    p.add_argument("--work", required=True, help="checkpoints, W&B files and the vanilla run dir live here")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=lambda v: v if v == "auto" else int(v), default=15,
                   help="checkpoint interval in steps; pack: or 'auto' (Young/Daly)")
    p.add_argument("--mtbf-hours", type=float, default=None, help="pack, --every auto: the MTBF (default: from the ledger)")
    p.add_argument("--batches-per-epoch", type=int, default=100, help="per rank; the data set holds this many")
    args = p.parse_args()
    work = Path(args.work)

    if args.arm == "pack":
        strategy = ETTStrategy()
        auto = {"mtbf_hours": args.mtbf_hours} if args.every == "auto" else {}
        callbacks = [ETTMonitor(report_on_end=False),
                     AsyncCheckpoint(work / "ckpt", every_n_train_steps=args.every, keep_last_n=1, **auto)]
    else:
        strategy = ETTStrategy() if args.arm == "same" else "ddp"
        callbacks = [ETTMonitor(run_dir=work / "run", report_on_end=False),
                     ModelCheckpoint(dirpath=work / "ckpt", every_n_train_steps=args.every, save_top_k=1, save_last="link")]
    logger = WandbLogger(project="ett-bench", save_dir=str(work), offline=True)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=logger,
                      callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=50)
    data = DataLoader(random_dataset(args.batches_per_epoch * BATCH_SIZE * trainer.world_size), batch_size=BATCH_SIZE,
                      shuffle=True)
    trainer.fit(UserModel(), data, ckpt_path=None if args.arm == "pack" else "last")


if __name__ == "__main__":
    main()
