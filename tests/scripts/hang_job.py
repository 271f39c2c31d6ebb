"""A 2-rank DDP job (gloo) for the hang watch: legitimate slow work and real hangs, each where a test puts it.

    hang_job.py --out DIR --ckpt-dir DIR [--act KIND:RANK:ATTEMPT[:SECONDS][@STEP] ...]

Slow work (CPU-bound, ``SECONDS`` long; a healthy job must finish in one attempt):

* ``rank_work``: after step ``STEP``, in ``on_train_batch_end`` (evaluation or sample logging on one rank);
* ``epoch_start``: in the DataLoader workers as the epoch containing step ``STEP`` starts (``--workers`` > 0);
* ``save``: in ``on_save_checkpoint`` of the save at or after step ``STEP`` (an uneven checkpoint save);
* ``recompile``: from step ``STEP`` on, this rank's batches have another size (``--compile``: a recompile);
* ``test``: ``trainer.test`` after ``fit``, each test step working.
* ``idle``: after step ``STEP``, an idle wait (``time.sleep``: a remote call, a lock), which looks like a hang.

Hangs (``time.sleep`` forever, or SIGSTOP), in attempt ``ATTEMPT`` only:

* ``hang_setup``: in ``LightningDataModule.setup``; ``hang_data``: in the DataLoader as an epoch starts;
* ``hang_save`` / ``hang_load``: in ``on_save_checkpoint`` / ``on_load_checkpoint`` (at or after step ``STEP``);
* ``hang_eval``: in ``validation_step`` (at or after step ``STEP``); ``hang_train``: in ``training_step`` at step ``STEP``;
* ``sigstop``: the rank SIGSTOPs itself after step ``STEP``.

Each rank writes ``OUT/rank<N>.pt`` (its step, losses of the last attempt) at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset, get_worker_info

from lightning_ett import AsyncCheckpoint, ETTMonitor, ModelPublisher

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("LIGHTNING_ETT_ATTEMPT", "0"))


@dataclass(frozen=True)
class Act:
    kind: str
    rank: int
    attempt: int | None  # None: every attempt
    seconds: float
    step: int

    def here(self, kind: str) -> bool:
        return self.kind == kind and self.rank == RANK and self.attempt in (None, ATTEMPT)


def parse_act(text: str) -> Act:
    text, _, step = text.partition("@")
    kind, rank, attempt, *seconds = text.split(":")
    return Act(kind, int(rank), None if attempt == "*" else int(attempt), float(seconds[0]) if seconds else 0.0,
               int(step or 0))


def busy(seconds: float) -> None:
    """CPU-bound work: what a real evaluation, export or loader start does."""
    deadline, x = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        x = (x * 31 + 7) % 1000003


def hang(what: str) -> None:
    print(f"hang_job: rank {RANK} hangs in {what} (attempt {ATTEMPT})", flush=True)
    while True:
        time.sleep(3600)


class Rows(Dataset):
    """Deterministic rows; its DataLoader workers do a slow (or hung) epoch start when asked."""

    def __init__(self, n: int, acts: list[Act], steps_per_epoch: int) -> None:
        self.n, self.acts, self.steps_per_epoch = n, acts, steps_per_epoch
        self.epoch = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, generator=g)
        return x, x.sum().unsqueeze(0)


def worker_start(_: int) -> None:
    info = get_worker_info()
    rows: Rows = info.dataset  # type: ignore[assignment]
    for act in rows.acts:
        if act.step // rows.steps_per_epoch == rows.epoch and act.step > 0:
            if act.here("epoch_start"):
                busy(act.seconds)
            if act.here("hang_data"):
                hang("a DataLoader worker's start")


class Data(LightningDataModule):
    def __init__(self, args: argparse.Namespace, acts: list[Act]) -> None:
        super().__init__()
        self.args, self.acts = args, acts
        self.rows = Rows(args.steps_per_epoch * args.batch * 2, acts, args.steps_per_epoch)  # 2 ranks' worth

    def setup(self, stage: str) -> None:
        if any(a.here("hang_setup") for a in self.acts):
            hang("LightningDataModule.setup")

    def train_dataloader(self) -> DataLoader:
        w = self.args.workers
        return DataLoader(self.rows, batch_size=self.args.batch, num_workers=w, persistent_workers=self.args.persistent and w > 0,
                          worker_init_fn=worker_start if w else None)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Rows(2 * self.args.batch, [], 1), batch_size=self.args.batch)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(Rows(2 * self.args.batch, [], 1), batch_size=self.args.batch)


class Model(LightningModule):
    def __init__(self, args: argparse.Namespace, acts: list[Act], rows: Rows) -> None:
        super().__init__()
        self.args, self.acts, self.rows = args, acts, rows
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.losses: list[float] = []
        self._saved_slowly = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_epoch_start(self) -> None:
        self.rows.epoch = self.current_epoch  # read by the DataLoader workers this epoch starts

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        for act in self.acts:
            if act.here("hang_train") and self.global_step == act.step:
                hang("training_step")
            if act.here("recompile") and self.global_step >= act.step:
                x, y = x[: len(x) // 2], y[: len(y) // 2]  # a new batch size on this rank: a recompile
        time.sleep(self.args.step_sleep)
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.losses.append(float(loss))
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if any(a.here("hang_eval") and self.global_step >= a.step for a in self.acts):
            hang("validation_step")
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        for act in self.acts:
            if act.here("test"):
                busy(act.seconds)
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def on_save_checkpoint(self, checkpoint):  # type: ignore[no-untyped-def]
        for act in self.acts:
            if self.global_step >= act.step and act.here("hang_save"):
                hang("on_save_checkpoint")
            if self.global_step >= act.step and act.here("save") and not self._saved_slowly:
                self._saved_slowly = True
                busy(act.seconds)

    def on_load_checkpoint(self, checkpoint):  # type: ignore[no-untyped-def]
        if any(a.here("hang_load") for a in self.acts):
            hang("on_load_checkpoint")

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Acts(Callback):
    """The acts that happen between steps (after ETTMonitor's own hook: the monitor is first in the list)."""

    def __init__(self, acts: list[Act]) -> None:
        self.acts = acts

    def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def]
        for act in self.acts:
            if act.here("rank_work") and trainer.global_step == act.step:
                busy(act.seconds)
            if act.here("idle") and trainer.global_step == act.step:
                time.sleep(act.seconds)
            if act.here("sigstop") and trainer.global_step == act.step:
                print(f"hang_job: rank {RANK} stops itself (attempt {ATTEMPT})", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--act", action="append", default=[], type=parse_act)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--steps-per-epoch", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--every", type=int, default=10, help="AsyncCheckpoint every N steps")
    p.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: never)")
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--publish-dir", default=None)
    p.add_argument("--test-after-fit", action="store_true")
    p.add_argument("--pg-timeout-s", type=float, default=None, help="the process group's timeout (default Lightning's)")
    args = p.parse_args()
    acts: list[Act] = args.act
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    callbacks: list[Callback] = [ETTMonitor(), AsyncCheckpoint(args.ckpt_dir, every_n_train_steps=args.every), Acts(acts)]
    if args.publish_dir:
        callbacks.append(ModelPublisher(args.publish_dir, submodule="net"))
    strategy = DDPStrategy(timeout=timedelta(seconds=args.pg_timeout_s)) if args.pg_timeout_s else DDPStrategy()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.max_steps, callbacks=callbacks,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=2 if args.val_every else 0, val_check_interval=args.val_every or None,
                      check_val_every_n_epoch=None if args.val_every else 1, num_sanity_val_steps=0)
    torch.manual_seed(0)
    data = Data(args, acts)
    model = Model(args, acts, data.rows)
    if args.compile:
        model.net = torch.compile(model.net)
    trainer.fit(model, datamodule=data)
    if args.test_after_fit:
        trainer.test(model, datamodule=data, verbose=False)
    torch.save({"global_step": trainer.global_step, "losses": model.losses, "attempt": ATTEMPT},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
