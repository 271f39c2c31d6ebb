"""A single-process Lightning job with AsyncCheckpoint, for the checkpoint tests.

Batches are generated from the global step, so a resumed run sees the same data as an
uninterrupted one. At the end the job writes its weights and facts to OUT/result.pt.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torchmetrics
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, IterableDataset

from lightning_ett import AsyncCheckpoint, ETTMonitor, ModelPublisher


class Steps(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            yield 0


class Regression(LightningModule):
    def __init__(self, width: int, step_sleep: float, data_seed: int = 0) -> None:
        super().__init__()
        self.data_seed = data_seed  # another fit of a loop (--fits) sees other data
        self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        self.step_sleep = step_sleep
        self.train_mse = torchmetrics.MeanSquaredError()

    def training_step(self, _batch, batch_idx):  # type: ignore[no-untyped-def]
        time.sleep(self.step_sleep)
        g = torch.Generator().manual_seed(self.global_step + self.data_seed)
        x = torch.randn(32, 16, generator=g)
        prediction = self.net(x).squeeze(-1)
        self.train_mse.update(prediction.detach(), x.sum(-1))
        return torch.nn.functional.mse_loss(prediction, x.sum(-1))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Faults(Callback):
    """Kill the process with SIGKILL, or plant a file where the writer needs a directory."""

    def __init__(self, kill_at: int | None, block_tmp_of: int | None, ckpt_dir: Path, sigterm_at: int | None = None,
                 after_durable: AsyncCheckpoint | None = None) -> None:
        self.kill_at, self.block_tmp_of, self.ckpt_dir, self.sigterm_at = kill_at, block_tmp_of, ckpt_dir, sigterm_at
        self.raise_at: int | None = None
        self.snapshots: set[int] = set()
        self.durable: set[int] = set()
        if after_durable is not None:  # kill only once every save begun was reported durable (at a batch end)
            after_durable.add_listener(self)

    def on_checkpoint_snapshot(self, trainer, step):  # type: ignore[no-untyped-def]
        self.snapshots.add(step)

    def on_checkpoint_durable(self, trainer, path, step):  # type: ignore[no-untyped-def]
        self.durable.add(step)

    def on_train_batch_start(self, trainer, *args):  # type: ignore[no-untyped-def]
        if self.block_tmp_of is not None and trainer.global_step == 1:
            (self.ckpt_dir / f"step-{self.block_tmp_of:09d}.tmp").write_text("not a directory")
        if self.kill_at is not None and trainer.global_step == self.kill_at:
            deadline = time.time() + 60
            while not self.snapshots <= self.durable and time.time() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.raise_at is not None and trainer.global_step == self.raise_at:
            raise RuntimeError(f"a training error at step {self.raise_at}")
        if self.sigterm_at is not None and trainer.global_step == self.sigterm_at and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's preemption notice


class BreakPublishDir(Callback):
    """Put a file where the publish directory was (every later publish fails), or just empty it."""

    def __init__(self, at: int, path: Path, empty_only: bool = False) -> None:
        self.at, self.path, self.empty_only = at, path, empty_only

    def on_train_batch_start(self, trainer, *args):  # type: ignore[no-untyped-def]
        if trainer.global_step == self.at and self.path.is_dir():
            import shutil

            deadline = time.time() + 60
            while self.empty_only and not (self.path / "latest").exists() and time.time() < deadline:
                time.sleep(0.05)  # something was published before the directory is emptied
            for _ in range(100):  # the publisher may be writing its next version into it meanwhile
                try:
                    shutil.rmtree(self.path)
                    break
                except OSError:
                    time.sleep(0.05)
            if self.empty_only:
                self.path.mkdir()
            else:
                self.path.write_text("not a directory")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--every", type=lambda v: v if v == "auto" else int(v), default=4, help="steps, or 'auto'")
    p.add_argument("--mtbf-hours", type=float, default=None, help="with --every auto")
    p.add_argument("--max-interval-minutes", type=float, default=60.0, help="with --every auto")
    p.add_argument("--every-minutes", type=float, default=None, help="instead of --every")
    p.add_argument("--devices", type=int, default=1, help="> 1: DDP on gloo (rank 0 writes the checkpoint)")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--when-busy", default="wait")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process at this step")
    p.add_argument("--block-tmp-of", type=int, default=None, help="make the save of this step fail (a file in the way)")
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--fits", type=int, default=1, help="> 1: a loop of fits, each its own Trainer and data (OUT/result-N.pt)")
    p.add_argument("--kill-in-fit", type=int, default=0, help="the fit of the loop --kill-at applies to")
    p.add_argument("--dir-per-fit", action="store_true", help="with --fits: each fit checkpoints to CKPT_DIR/fitN")
    p.add_argument("--kill-when-durable", action="store_true", help="--kill-at waits until every save begun is durable")
    p.add_argument("--verbose", action="store_true", help="AsyncCheckpoint(verbose=True)")
    p.add_argument("--raise-at", type=int, default=None, help="raise a RuntimeError at this step")
    p.add_argument("--sigterm-at", type=int, default=None, help="send SIGTERM to rank 0 at this step")
    p.add_argument("--publish-dir", default=None, help="add ModelPublisher(dirpath=...)")
    p.add_argument("--publish-metrics", default="", help="comma-separated ModelPublisher metrics")
    p.add_argument("--publish-strict", action="store_true")
    p.add_argument("--publish-keep", type=int, default=5)
    p.add_argument("--break-publish-dir-at", type=int, default=None, help="replace the publish dir by a file at this step")
    p.add_argument("--empty-publish-dir-at", type=int, default=None, help="delete everything in the publish dir at this step")
    args = p.parse_args()

    out, ckpt_dir = Path(args.out), Path(args.ckpt_dir)
    out.mkdir(parents=True, exist_ok=True)
    interval = {"every_n_minutes": args.every_minutes} if args.every_minutes else {"every_n_train_steps": args.every}
    if args.every == "auto":
        interval.update(mtbf_hours=args.mtbf_hours, max_interval_minutes=args.max_interval_minutes)
    for fit in range(args.fits):
        fit_once(args, out, ckpt_dir / f"fit{fit}" if args.dir_per_fit else ckpt_dir, interval, fit)


def fit_once(args: argparse.Namespace, out: Path, ckpt_dir: Path, interval: dict, fit: int) -> None:
    checkpoint = AsyncCheckpoint(ckpt_dir, keep_last_n=args.keep, when_busy=args.when_busy, verbose=args.verbose,
                                 **interval)
    kill_at = args.kill_at if fit == args.kill_in_fit else None
    callbacks = [ETTMonitor(run_dir=out / "ett", report_on_end=False), checkpoint,
                 Faults(kill_at, args.block_tmp_of, ckpt_dir, args.sigterm_at,
                        checkpoint if args.kill_when_durable else None)]
    callbacks[-1].raise_at = args.raise_at
    if args.publish_dir:
        callbacks.append(ModelPublisher(args.publish_dir, keep_last_n=args.publish_keep, strict=args.publish_strict,
                                        metrics=[m for m in args.publish_metrics.split(",") if m]))
        if args.break_publish_dir_at is not None:
            callbacks.append(BreakPublishDir(args.break_publish_dir_at, Path(args.publish_dir)))
        if args.empty_publish_dir_at is not None:
            callbacks.append(BreakPublishDir(args.empty_publish_dir_at, Path(args.publish_dir), empty_only=True))
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
                      max_steps=args.max_steps, callbacks=callbacks,
                      logger=CSVLogger(out, name="csv", version=0), log_every_n_steps=1, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    torch.manual_seed(0)
    model = Regression(args.width, args.step_sleep, data_seed=1000 * fit)
    trainer.fit(model, DataLoader(Steps(), batch_size=None), ckpt_path=args.ckpt_path)
    (out / f"best_model_path-{trainer.global_rank}.txt").write_text(checkpoint.best_model_path)
    if trainer.global_rank != 0:
        return
    torch.save({"weights": {k: v.clone() for k, v in model.state_dict().items()}, "global_step": trainer.global_step,
                "resumed_from": trainer.ckpt_path, "saves": checkpoint.saves, "skipped": checkpoint.skipped},
               out / ("result.pt" if args.fits == 1 else f"result-{fit}.pt"))


if __name__ == "__main__":
    main()
