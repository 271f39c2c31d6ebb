"""One incremental-checkpoint measurement: ETTStrategy on 2 ranks, GIB GiB of tables, saves every N steps by ARM.

Arms (``--arm``), all with the same retention (the newest checkpoint kept, the one before it
deleted once the new one is durable; an incremental chain keeps what the newest needs):

* ``full``: ``AsyncCheckpoint(every_n_train_steps=N, keep_last_n=1)``;
* ``incremental``: the same with ``incremental=True``;
* ``dcp_async``: ``torch.distributed.checkpoint.async_save`` every N steps with the best DCP setup
  for TorchRec's ShardedTensors on this machine (``benchmarks/checkpoint_job.py``: CPU buffers made
  once and reused, a gloo group of its own, old checkpoints purged in a thread as torchtitan does).

A save that comes due while the previous one is being written is skipped, in every arm.

The model: 8 tables of DIM-wide fp32 rows (table-wise on 2 ranks), TorchRec's fused row-wise
AdaGrad, a dense MLP. Each step every rank looks up BATCH ids per table, drawn from ``--stream``:
``zipf`` (a truncated Zipf law of exponent ``--alpha`` over the rows, hot rows scattered by a fixed
permutation) or ``uniform`` (the worst case for deltas). After WARMUP steps, BASELINE steps run
without saves (the step time to compare with), then WINDOW steps with saves. Rank 0 writes OUT
(JSON): bytes written by the window's saves, its wall time, the saves made and skipped, the
training time they cost (window wall minus window steps x the baseline median step: blocked +
slowdown, as checkpoint_cost.py defines it), and the fraction of rows each interval touched.

``--restore``: keep every checkpoint and, after the window, time restoring each on every rank, 3 times
cold (page cache dropped first) and 3 times warm, with its chain length, after one untimed warm-up restore.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, IterableDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from checkpoint_job import Saver, agree
from id_streams import ZipfLaw

TABLES, DIM, BATCH = 8, 64, 512
WARMUP, BASELINE = 10, 40


class Steps(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            yield 0


class IdStream:
    """Ids for (step, rank): Zipf(alpha) truncated to ``rows`` (inverse CDF), or uniform; the same in every arm."""

    def __init__(self, rows: int, stream: str, alpha: float) -> None:
        self.rows = rows
        self.law = ZipfLaw(rows, alpha) if stream == "zipf" else None

    def ids(self, n: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        if self.law is None:
            return torch.randint(0, self.rows, (n,), generator=g)
        return self.law.rows_for(torch.rand(n, generator=g, dtype=torch.float64))


class Tables(LightningModule):
    def __init__(self, gib: float, stream: str, alpha: float) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()
        self.rows = int(gib * 2**30 / 4 / DIM / TABLES)
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=self.rows, feature_names=[f"f{i}"])
            for i in range(TABLES)], device=torch.device("meta"))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(TABLES * DIM, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                       torch.nn.ReLU(), torch.nn.Linear(512, 1))
        self.stream = IdStream(self.rows, stream, alpha)
        self.touched = torch.zeros(TABLES, self.rows, dtype=torch.bool)  # since the last interval mark, all ranks' ids
        self.since_first = torch.zeros(TABLES, self.rows, dtype=torch.bool)  # since the window's first mark
        self.marks = 0

    def training_step(self, _batch, batch_idx):  # type: ignore[no-untyped-def]
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        world = self.trainer.world_size
        every_rank = [self.stream.ids(TABLES * BATCH, (self.global_step * world + r) * 7919) for r in range(world)]
        for ids in every_rank:  # what the tables see this step (cheap: a scatter of bools)
            self.touched.view(TABLES, self.rows)[torch.arange(TABLES).repeat_interleave(BATCH), ids] = True
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(TABLES)], values=every_rank[self.global_rank],
                                                  lengths=torch.ones(TABLES * BATCH, dtype=torch.int32))
        return self.mlp(self.ebc(kjt).values()).pow(2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adagrad(self.parameters(), lr=1e-3)  # the tables go to ETTStrategy's fused optimizer

    def touched_fractions(self) -> tuple[float, float]:
        """Rows touched since the last mark (a consecutive delta's rows) and since the first (a one-shot
        differential's against a full save made at the first mark); looked-up rows are the rows that change."""
        fraction = float(self.touched.float().mean())
        if self.marks:  # (before the first mark: the steps before that full save)
            self.since_first |= self.touched
        self.marks += 1
        self.touched.zero_()
        return fraction, float(self.since_first.float().mean())


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Driver(Callback):
    """warm-up -> baseline (no saves) -> window (a save attempt every N steps, skipped while one is in flight)."""

    def __init__(self, saver: Saver, every: int, window: int) -> None:
        self.saver, self.every, self.window = saver, every, window
        self.step_start = 0.0
        self.baseline: list[float] = []
        self.window_start = 0.0
        self.window_steps = 0
        self.in_flight: Path | None = None  # rank 0: the save being written (its bytes counted once durable)
        self.saves: list[dict[str, Any]] = []  # rank 0: each durable save
        self.skipped = 0
        self.blocked: list[float] = []
        self.fractions: list[float] = []
        self.union_fractions: list[float] = []
        self.done_at: float | None = None
        self.staging_bytes = 0  # ours: the most staging memory held (both buffer sets when incremental)

    def on_before_backward(self, trainer, *args):  # type: ignore[no-untyped-def]
        self.saver.ready()  # the fused optimizer updates the tables inside backward

    def on_train_batch_start(self, trainer, *args):  # type: ignore[no-untyped-def]
        self.step_start = time.perf_counter()

    def _landed(self, trainer: Trainer) -> None:
        """The save in flight is durable on every rank: count its bytes (rank 0), apply retention."""
        checkpoint = self.saver.async_checkpoint
        if checkpoint is not None:  # ours: reported as AsyncCheckpoint reports a save (its chain policy counts it)
            checkpoint._report(trainer, checkpoint._writer.wait())
        else:
            self.saver.finish()
        if trainer.global_rank == 0 and self.in_flight is not None:
            path = self.in_flight
            if self.saver.async_checkpoint is not None:
                path = Path(self.saver.async_checkpoint.best_model_path)
            manifest = path / "manifest.json"
            fields = json.loads(manifest.read_text()) if manifest.is_file() else {}
            kind = "rebase" if fields.get("rebase") else fields.get("kind", "full")
            self.saves.append({"path": path.name, "bytes": directory_bytes(path), "kind": kind})
            if checkpoint is not None:
                self.staging_bytes = max(self.staging_bytes, checkpoint._stager.nbytes)
        self.in_flight = None

    def on_train_batch_end(self, trainer, pl_module, *args):  # type: ignore[no-untyped-def]
        step = trainer.global_step
        done = agree(self.saver.done())
        if step <= WARMUP:
            return
        if step <= WARMUP + BASELINE:
            self.baseline.append(time.perf_counter() - self.step_start)
            self.window_start = time.perf_counter()
            return
        self.window_steps += 1
        if self.in_flight is not None and done:
            self._landed(trainer)
        if self.window_steps % self.every == 0:
            interval, since_first = pl_module.touched_fractions()
            self.fractions.append(interval)
            self.union_fractions.append(since_first)
            if self.in_flight is None:
                t = time.perf_counter()
                self.saver.start(trainer)
                self.blocked.append(time.perf_counter() - t)
                self.in_flight = self.saver.async_checkpoint.dirpath if self.saver.async_checkpoint else self.saver.kept
            else:
                self.skipped += 1
        if self.window_steps >= self.window:
            if self.saver.async_checkpoint is not None:
                self.saver.async_checkpoint._settle()  # ours: no next step will settle the snapshot; its verdict now
            while self.in_flight is not None and not agree(self.saver.done()):
                time.sleep(0.01)  # the window ends when its last save is durable: its bytes and time are in it
            if self.in_flight is not None:
                self._landed(trainer)
            self.done_at = time.perf_counter()
            trainer.should_stop = True


RESTORE_REPS = 3  # each checkpoint restored this many times, cold and warm: one restore's noise is a full restore's


def restore_times(trainer: Trainer, root: Path) -> list[dict[str, Any]]:
    """Every rank: restore each committed checkpoint RESTORE_REPS times cold (its chain's pages dropped), then as many
    times warm; slowest rank's seconds, with its chain length and the full save it builds on.

    Repeated, in a reversed order every other pass, because on this VM one cold restore of the same full save
    varies by up to 1.6x from pass to pass (the host's own cache, the allocator after the previous restore), as
    much as a whole chain adds; a single pass made chains of some lengths look slower than longer ones.
    """
    from lightning_ett.checkpoint import layout as fmt
    from lightning_ett.checkpoint import sharded
    from lightning_ett.durable.manifest import drop_from_cache

    strategy = trainer.strategy
    entries = fmt.committed(root)
    sharded.load_model(entries[0].path, strategy.model)  # warm-up, not timed: the first load's one-time costs
    sharded.load_fused(entries[0].path, strategy.fused_optimizer_instance)
    chains = {e.path.name: fmt.chain_of(e.path) for e in entries}  # each manifest read once, not per restore
    results = {e.path.name: {"step": e.step, "deltas": len(chains[e.path.name]) - 1,
                             "path": "".join("R" if (fmt.read_manifest(m, fmt.FORMAT) or {}).get("rebase") else "d"
                                             for m in chains[e.path.name][1:]),  # its chain after the full save
                             "base": chains[e.path.name][0].name, "cold": [], "warm": [],
                             "bytes": sum(directory_bytes(m) for m in chains[e.path.name])} for e in entries}
    for cold in (True, False):
        for rep in range(RESTORE_REPS):
            for entry in entries if rep % 2 == 0 else entries[::-1]:
                for member in chains[entry.path.name] if cold else ():
                    for f in member.iterdir():
                        drop_from_cache(f)
                if not cold and rep == 0:  # warm: read once untimed, so every page is cached
                    sharded.load_model(entry.path, strategy.model)
                dist.barrier()
                t = time.perf_counter()
                sharded.load_model(entry.path, strategy.model)
                sharded.load_fused(entry.path, strategy.fused_optimizer_instance)
                seconds = torch.tensor([time.perf_counter() - t])
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                results[entry.path.name]["cold" if cold else "warm"].append(float(seconds))
    return list(results.values())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arm", choices=("full", "incremental", "dcp_async"), required=True)
    p.add_argument("--stream", choices=("zipf", "uniform"), default="zipf")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--every", type=int, required=True)
    p.add_argument("--window", type=int, required=True, help="steps with saves")
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--restore", action="store_true", help="keep every checkpoint, then time restoring each")
    p.add_argument("--full-every", type=int, default=None, help="incremental: full_every_n_saves")
    args = p.parse_args()
    from lightning_ett import ETTStrategy

    root = Path(args.dir)
    torch.manual_seed(0)
    saver = Saver("ours" if args.arm != "dcp_async" else "dcp_async_stager", root, single_process=False)
    if saver.async_checkpoint is not None:
        from lightning_ett import AsyncCheckpoint

        saver.async_checkpoint = AsyncCheckpoint(root, every_n_train_steps=10**9, keep_last_n=None if args.restore else 1,
                                                 save_on_train_end=False, resume=False,
                                                 incremental=args.arm == "incremental",
                                                 full_every_n_saves=args.full_every if args.arm == "incremental" else None)
    driver = Driver(saver, args.every, args.window)
    callbacks: list[Callback] = [driver] + ([saver.async_checkpoint] if saver.async_checkpoint is not None else [])
    model = Tables(args.gib, args.stream, args.alpha)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ETTStrategy(sharding_type="table_wise"), max_steps=10**6,
                      callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=saver.async_checkpoint is not None, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(Steps(), batch_size=None))
    restores = restore_times(trainer, root) if args.restore else []
    if trainer.global_rank != 0:
        return
    assert driver.done_at is not None
    wall = driver.done_at - driver.window_start
    step = statistics.median(driver.baseline)
    written = sum(s["bytes"] for s in driver.saves)
    Path(args.out).write_text(json.dumps({
        "arm": args.arm, "stream": args.stream, "alpha": args.alpha, "every": args.every, "gib": args.gib,
        "window_steps": driver.window_steps, "window_s": wall, "step_s": step,
        "cost_s": wall - driver.window_steps * step, "saves": driver.saves, "skipped": driver.skipped,
        "bytes": written, "bytes_per_hour": written / wall * 3600, "blocked_s": driver.blocked,
        "touched_fraction": driver.fractions, "touched_since_first": driver.union_fractions, "restores": restores,
        "staging_bytes": driver.staging_bytes,
    }))


if __name__ == "__main__":
    main()
