"""A small Lightning job for subprocess tests: BoringModel + ETTMonitor + real checkpoints.

Options let a test slow steps, saves and validation down by known amounts, resume from the
newest checkpoint, or block wandb's import to prove the monitor does without it.
"""

from __future__ import annotations

import argparse
import atexit
import sys
import time
from pathlib import Path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--save-sleep", type=float, default=0.0)
    p.add_argument("--val-every", type=int, default=0)
    p.add_argument("--val-sleep", type=float, default=0.0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--csv-dir", default=None)
    p.add_argument("--wandb-dir", default=None)
    p.add_argument("--ett-strategy", action="store_true")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--report", default=None, help="write per-rank facts about the run here")
    p.add_argument("--block-wandb", action="store_true")
    p.add_argument("--exit-stamp", default=None, help="write the time the last exit handler ran here")
    return p.parse_args()


def main() -> None:
    args = parse()
    if args.exit_stamp:  # registered before any library's handler: it runs after all of them
        atexit.register(lambda: Path(args.exit_stamp).write_text(repr(time.time())))
    if args.block_wandb:
        sys.modules["wandb"] = None  # type: ignore[assignment]  # import wandb now raises ImportError

    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.loggers import CSVLogger, WandbLogger
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from lightning_ett import ETTMonitor, ETTStrategy

    class SlowSaveIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):  # type: ignore[no-untyped-def]
            time.sleep(args.save_sleep)
            super().save_checkpoint(checkpoint, path, storage_options)

    class Model(BoringModel):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            time.sleep(args.step_sleep)
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            time.sleep(args.val_sleep)
            return super().validation_step(batch, batch_idx)

    torch.manual_seed(0)
    callbacks = [ETTMonitor(run_dir=args.run_dir, log_every_n_steps=5)]
    if args.save_every:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.save_every, save_top_k=-1,
                                         save_last=True))
    loggers = []
    if args.csv_dir:
        loggers.append(CSVLogger(args.csv_dir))
    if args.wandb_dir:
        loggers.append(WandbLogger(save_dir=args.wandb_dir, offline=True, project="lightning-ett-tests"))
    trainer = Trainer(
        # Lightning's default ModelCheckpoint writes under default_root_dir (the cwd unless set): never the checkout.
        default_root_dir=f"{args.run_dir}-trainer",
        max_steps=args.max_steps,
        limit_train_batches=1000,
        val_check_interval=args.val_every or None,
        limit_val_batches=2 if args.val_every else 0,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=None if args.val_every else 1,
        logger=loggers or False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[] if args.ett_strategy else [SlowSaveIO()],
        strategy=ETTStrategy() if args.ett_strategy else "auto",
        accelerator="cpu",
        devices=args.devices,
    )
    ckpt = None
    if args.resume and args.ckpt_dir and (Path(args.ckpt_dir) / "last.ckpt").exists():
        ckpt = str(Path(args.ckpt_dir) / "last.ckpt")
    model = Model()
    trainer.fit(model, ckpt_path=ckpt)
    if args.report:
        import json

        sampler = type(trainer.train_dataloader.sampler).__name__
        Path(args.report).mkdir(parents=True, exist_ok=True)
        (Path(args.report) / f"rank{trainer.global_rank}.json").write_text(json.dumps({"sampler": sampler}))
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   Path(args.report) / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
