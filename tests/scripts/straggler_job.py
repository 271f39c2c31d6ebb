"""A small 2-rank DDP job on CPU for the straggler tests: an MLP, ETTMonitor with the straggler diagnosis.

Run directly (``python straggler_job.py``: Lightning's own launcher starts the second rank) or under
``lightning run --devices 2`` (``--run-dir`` omitted: the launcher's). ``LIGHTNING_ETT_FAULT_SLOW``
slows a rank down. Each rank writes its step count to ``--out`` when it finishes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--run-dir", default=None, help="ETTMonitor's run dir; default: the launcher's or the default")
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--every", type=int, default=25, help="ETTMonitor(straggler_every_n_steps=...)")
    p.add_argument("--csv-dir", default=None)
    p.add_argument("--wandb-dir", default=None, help="log to an offline WandbLogger here")
    return p.parse_args()


def main() -> None:
    args = parse()
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.loggers import CSVLogger, WandbLogger
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ett import ETTMonitor

    torch.set_num_threads(1)  # two ranks on a small machine: no oversubscription noise

    class MLP(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    loggers = [CSVLogger(args.csv_dir)] if args.csv_dir else []
    if args.wandb_dir:
        loggers.append(WandbLogger(save_dir=args.wandb_dir, offline=True, project="lightning-ett-tests"))
    data = TensorDataset(torch.randn(512, 32), torch.randn(512, 1))
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=args.max_steps, limit_val_batches=0,
        logger=loggers or False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ETTMonitor(run_dir=args.run_dir, log_every_n_steps=25, straggler_every_n_steps=args.every)],
    )
    trainer.fit(MLP(), DataLoader(data, batch_size=16))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{trainer.global_rank}.json").write_text(json.dumps({"global_step": trainer.global_step}))


if __name__ == "__main__":
    main()
