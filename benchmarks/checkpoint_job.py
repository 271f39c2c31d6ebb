"""One checkpoint-cost measurement: a Lightning job with GIB GiB of state saved by METHOD.

The model is a GIB-GiB embedding table (sparse SGD updates a few rows per step, as a
recommendation model's tables are updated) feeding a dense MLP whose step takes tens of ms.
One warm-up save (whatever a method reuses is then warm), then ``--saves`` measured saves;
the medians are reported:

* blocked: seconds the training thread spent in the save, plus, for the methods that stage in
  the background (ours, DCP with a reused async stager, thread or process), the wait for
  staging to finish right before the next step's optimizer step, the first thing that changes
  this model's state (torchtitan waits at the same point);
* cost: blocked + the extra step time (over the median step without a save) of every step that
  ran while the write was in flight — on a 2-core machine the writer competes with training.

Writes a JSON line to OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, IterableDataset

DIM, BATCH = 256, 1024
METHODS = ("torch_save", "lightning_async", "dcp_async_default", "dcp_async_stager", "dcp_async_process", "ours")


class Steps(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            yield 0


class BigState(LightningModule):
    def __init__(self, gib: float) -> None:
        super().__init__()
        self.rows = int(gib * 2**30 / 4 / DIM)
        self.table = torch.nn.Embedding(self.rows, DIM, sparse=True, _weight=torch.zeros(self.rows, DIM))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                       torch.nn.ReLU(), torch.nn.Linear(1024, 1))

    def training_step(self, _batch, batch_idx):  # type: ignore[no-untyped-def]
        ids = torch.randint(0, self.rows, (BATCH,), generator=torch.Generator().manual_seed(self.global_step))
        return self.mlp(self.table(ids)).pow(2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _stager(process: bool) -> Any:
    """DCP's DefaultStager as torchtitan configures it (``async_with_pinned_mem``), minus what needs CUDA.

    Pinned memory and non-blocking copies assert on a CPU-only machine; shared memory is what
    the process-based checkpointer hands its worker the staged tensors in.
    """
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=process, use_async_staging=True,
                                        use_non_blocking_copy=False))


class Saver:
    """start(trainer): the blocking part; ready(): before the next mutation; done(); finish(): durable.

    Retention is the same for every method: after a save is durable, the one before it is
    deleted (ours: ``keep_last_n=1``, in its writer; the others on the training thread when
    the save is seen complete, as Lightning's ModelCheckpoint deletes, and that time is part
    of their cost), so every method writes next to one earlier checkpoint.
    """

    def __init__(self, method: str, root: Path) -> None:
        self.method, self.root, self.n = method, root, 0
        self.future: Any = None
        self.staging: Any = None
        self.waited = 0.0  # seconds ready() blocked the training thread for the save in flight
        self.async_checkpoint: Any = None
        self.snapshot: Any = None
        self.kept: Path | None = None  # the newest save of a baseline, and the one before it (deleted once durable)
        self.previous: Path | None = None
        if method in ("dcp_async_stager", "dcp_async_process"):
            self.stager = _stager(process=method == "dcp_async_process")
        if method == "dcp_async_process":
            import torch.distributed as dist

            if not dist.is_initialized():  # the process-based checkpointer needs a process group, even of one
                from lightning.fabric.plugins.environments.lightning import find_free_network_port

                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_network_port()))
                dist.init_process_group("gloo", rank=0, world_size=1)
        if method == "ours":
            from lightning_ett import AsyncCheckpoint

            self.async_checkpoint = AsyncCheckpoint(root, every_n_train_steps=10**9, keep_last_n=1,
                                                    save_on_train_end=False, resume=False)

    def start(self, trainer: Trainer) -> None:
        import torch.distributed.checkpoint as dcp

        self.n += 1
        self.waited = 0.0
        path = self.root / f"save{self.n}"
        if self.method == "torch_save":
            trainer.save_checkpoint(path)
        elif self.method == "lightning_async":
            trainer.save_checkpoint(path)
            self.future = trainer.strategy.checkpoint_io._executor.submit(lambda: None)  # FIFO: done after the save
        elif self.method == "dcp_async_default":
            self.future = dcp.async_save({"model": trainer.lightning_module.state_dict()}, checkpoint_id=str(path))
        elif self.method in ("dcp_async_stager", "dcp_async_process"):
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            kind = AsyncCheckpointerType.PROCESS if self.method == "dcp_async_process" else AsyncCheckpointerType.THREAD
            response = dcp.async_save({"model": trainer.lightning_module.state_dict()}, checkpoint_id=str(path),
                                      async_stager=self.stager, async_checkpointer_type=kind)
            self.staging, self.future = response.staging_completion, response.upload_completion
        else:
            self.async_checkpoint._save(trainer)
            self.snapshot = self.async_checkpoint._snapshot
        if self.method != "ours":
            self.previous, self.kept = self.kept, path

    def ready(self) -> None:
        """Right before the optimizer step, the first mutation of this model (torchtitan waits there too)."""
        if self.staging is not None:
            t = time.perf_counter()
            self.staging.result()
            self.waited += time.perf_counter() - t
            self.staging = None

    def waited_s(self) -> float:
        """The part of the save's blocking that happened inside a training step."""
        return self.snapshot.settle_wait_s if self.snapshot is not None else self.waited

    def done(self) -> bool:
        if self.method == "ours":
            return not self.async_checkpoint._writer.busy
        return self.future is None or self.future.done()

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()
        if self.method == "ours":
            self.async_checkpoint._writer.wait()
        elif self.previous is not None:
            shutil.rmtree(self.previous) if self.previous.is_dir() else self.previous.unlink()
            self.previous = None


class Driver(Callback):
    """warm-up -> save 0 (not measured) -> drain -> K x [baseline steps -> measured save -> drain] -> stop.

    Several measured saves in one process: the steady state of a job that checkpoints
    periodically (buffers warm, one earlier checkpoint on disk), and a median against noise.
    """

    def __init__(self, saver: Saver, measured_saves: int, baseline_steps: int = 20) -> None:
        self.saver, self.measured_saves, self.baseline_steps = saver, measured_saves, baseline_steps
        self.stage, self.count, self.step_start = "warmup", 0, 0.0
        self.baseline: list[float] = []
        self.during: list[float] = []
        self.blocked = 0.0
        self.write_started = 0.0
        self.results: list[dict[str, float]] = []
        self.staging_bytes: int | None = None

    def on_before_optimizer_step(self, trainer, *args):  # type: ignore[no-untyped-def]
        self.saver.ready()

    def on_train_batch_start(self, trainer, *args):  # type: ignore[no-untyped-def]
        self.step_start = time.perf_counter()

    def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def]
        step_s = time.perf_counter() - self.step_start
        self.count += 1
        if self.stage == "warmup" and self.count >= 5:
            self.saver.start(trainer)
            self.stage, self.count = "drain", 0
        elif self.stage == "drain":
            if self.saver.done() and self.count >= 3:
                self.saver.finish()
                if len(self.results) == self.measured_saves:
                    trainer.should_stop = True
                    self.stage = "stopped"
                else:
                    self.stage, self.count, self.baseline = "baseline", 0, []
        elif self.stage == "baseline":
            self.baseline.append(step_s)
            if self.count >= self.baseline_steps:
                if self.saver.async_checkpoint is not None:
                    self.staging_bytes = self.saver.async_checkpoint._stager.nbytes
                t = time.perf_counter()
                self.saver.start(trainer)
                self.blocked = time.perf_counter() - t
                self.write_started = t
                self.stage, self.count, self.during = "measure", 0, []
        elif self.stage == "measure":
            self.during.append(step_s)
            if self.saver.done():
                write_s = time.perf_counter() - self.write_started
                t = time.perf_counter()
                self.saver.finish()  # baselines: delete the previous checkpoint now, on the training thread
                retention_s = time.perf_counter() - t  # (as ModelCheckpoint does); ours deleted it in its writer
                step = statistics.median(self.baseline)
                waited = self.saver.waited_s()  # blocked inside a step: counted as blocked, not as slowdown
                slowdown = sum(self.during) - waited - step * len(self.during) + retention_s  # unclipped: noise cancels
                blocked = self.blocked + waited
                self.results.append({"blocked_s": blocked, "boundary_s": self.blocked, "waited_s": waited,
                                     "slowdown_s": slowdown, "cost_s": blocked + slowdown, "write_s": write_s,
                                     "steps_during_write": len(self.during), "step_s": step})
                self.stage, self.count = "drain", 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--gib", type=float, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--saves", type=int, default=5, help="measured saves (after one warm-up save)")
    args = p.parse_args()
    root = Path(args.dir)
    torch.manual_seed(0)
    saver = Saver(args.method, root)
    driver = Driver(saver, args.saves)
    callbacks: list[Callback] = [driver] + ([saver.async_checkpoint] if saver.async_checkpoint is not None else [])
    plugins = []
    if args.method == "lightning_async":
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        plugins.append(AsyncCheckpointIO())
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=100_000, callbacks=callbacks, plugins=plugins, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=args.method == "ours",
                      limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(BigState(args.gib), DataLoader(Steps(), batch_size=None))
    medians = {k: statistics.median(r[k] for r in driver.results) for k in driver.results[0]}
    Path(args.out).write_text(json.dumps({"method": args.method, "gib": args.gib, **medians, "saves": driver.results,
                                          "staging_bytes": driver.staging_bytes}))


if __name__ == "__main__":
    main()
