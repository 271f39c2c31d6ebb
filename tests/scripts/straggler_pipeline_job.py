"""A 2-rank TorchRec job under ETTStrategy's pipeline for the straggler tests: rank ``--slow-rank``'s data set is slow.

ETTStrategy reads a sized loader one batch ahead inside the training step, before the forward's first
collective, where a slow read hid from the stamps taken at Lightning's hooks. Start it with
``lightning run --devices 2``.
"""

from __future__ import annotations

import argparse
import os
import time


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--slow-rank", type=int, default=None, help="this rank's data set sleeps --slow-s per batch")
    p.add_argument("--slow-s", type=float, default=0.05)
    return p.parse_args()


def main() -> None:
    args = parse()
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    from lightning_ett import ETTMonitor, ETTStrategy

    torch.set_num_threads(1)
    rank, batch = int(os.environ["RANK"]), 64

    class Batches(torch.utils.data.Dataset):
        """Sized and map-style (the pipeline reads it a batch ahead); one item is one whole batch."""

        def __init__(self) -> None:
            g = torch.Generator().manual_seed(rank)
            self.items = []
            for _ in range(args.max_steps + 1):
                lengths = torch.randint(0, 4, (batch,), generator=g, dtype=torch.int32)
                ids = torch.randint(0, 2000, (int(lengths.sum()),), generator=g)
                self.items.append((KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=ids, lengths=lengths),
                                   torch.randint(0, 2, (batch,), generator=g).float()))

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
            if rank == args.slow_rank:
                time.sleep(args.slow_s)  # a slow reader (decoding, a remote store) on this rank only
            return self.items[i]

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=2000,
                                                                         feature_names=["f0"])], device=torch.device("meta"))
            self.top = nn.Linear(16, 1)

        def training_step(self, b, i):  # type: ignore[no-untyped-def]
            kjt, y = b
            logits = self.top(self.ebc(kjt).values()).squeeze(-1)
            return nn.functional.binary_cross_entropy_with_logits(logits, y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.Adagrad(self.top.parameters(), lr=0.05)

    trainer = Trainer(accelerator="cpu", devices=2, strategy=ETTStrategy(), callbacks=[ETTMonitor()],
                      max_steps=args.max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(Model(), torch.utils.data.DataLoader(Batches(), batch_size=None))


if __name__ == "__main__":
    main()
