"""One checkpoint-cost measurement: a Lightning job with GIB GiB of state saved by METHOD.

Two models (``--model``):

* ``ett``: what this pack exists for. ETTStrategy on 2 gloo ranks, an ``EmbeddingBagCollection``
  of 8 tables (GIB GiB in all, table-wise sharded: GIB/2 per rank) updated by TorchRec's fused
  row-wise AdaGrad *inside backward*, and a dense MLP (Adagrad). A method that stages in the
  background must finish before backward, so only the forward can hide it.
* ``embedding``: one process, a GIB-GiB ``nn.Embedding`` with sparse SGD (nothing changes before
  the optimizer step, so forward and backward can hide the late copy) and the same dense MLP.

One warm-up save (whatever a method reuses is then warm), then ``--saves`` measured saves;
per save and per rank:

* blocked: seconds the training thread spent in the save, plus, for the methods that stage in
  the background (ours, DCP with a reused async stager, thread or process), the wait for
  staging to finish right before the first thing that changes the saved state: backward under
  the fused optimizer, else the optimizer step (torchtitan waits at the same point);
* cost: blocked + the extra step time (over the median step without a save) of every step that
  ran while the write was in flight — on a 2-core machine the writer competes with training.

Rank 0 writes a JSON line to OUT, rank r > 0 to OUT.r.
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

import checkpoint_writer_phases  # stdlib only until --phases installs its timers
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, IterableDataset

DIM, BATCH, TABLES = 256, 1024, 8
ETT_BATCH = 256  # per rank: one thread per rank, a step of tens of ms as BigState's
# The first method of each model is the synchronous reference of goal (a). Lightning's
# AsyncCheckpointIO has no ETTStrategy arm: ETTStrategy writes with DCP, not through a CheckpointIO.
METHODS = {
    "embedding": ("torch_save", "lightning_async", "dcp_async_default", "dcp_async_stager", "dcp_async_process", "ours"),
    "ett": ("sync_dcp", "dcp_async_default", "dcp_async_stager", "dcp_async_process", "ours"),
}
DCP_METHODS = ("dcp_async_default", "dcp_async_stager", "dcp_async_process")


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


class ShardedState(LightningModule):
    """GIB GiB of TorchRec tables (sharded by ETTStrategy, fused row-wise AdaGrad) + a dense MLP."""

    def __init__(self, gib: float) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()
        self.rows = int(gib * 2**30 / 4 / DIM / TABLES)
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=self.rows, feature_names=[f"f{i}"])
            for i in range(TABLES)])
        # Narrower than BigState's: one thread per rank here, for a step of tens of ms as there.
        self.mlp = torch.nn.Sequential(torch.nn.Linear(TABLES * DIM, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                       torch.nn.ReLU(), torch.nn.Linear(256, 1))

    def training_step(self, _batch, batch_idx):  # type: ignore[no-untyped-def]
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        seed = self.global_step * self.trainer.world_size + self.global_rank
        ids = torch.randint(0, self.rows, (TABLES * ETT_BATCH,), generator=torch.Generator().manual_seed(seed))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(TABLES)], values=ids,
                                                  lengths=torch.ones(TABLES * ETT_BATCH, dtype=torch.int32))
        return self.mlp(self.ebc(kjt).values()).pow(2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adagrad(self.parameters(), lr=1e-3)  # ETTStrategy routes the tables to the fused optimizer


def agree(done: bool) -> bool:
    """True on every rank only if it is true on every rank: collective saves start on all ranks or none."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return done
    flag = torch.tensor([int(done)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _dcp_state(trainer: Trainer) -> dict[str, Any]:
    """What a DCP user saves: the model's state (ShardedTensors under ETTStrategy) and the fused optimizer's."""
    strategy = trainer.strategy
    fused = getattr(strategy, "fused_optimizer_instance", None)
    state = {"model": strategy.lightning_module_state_dict()}
    if fused is not None:
        state["fused"] = fused.state_dict()
    return state


def _stager(process: bool, sharded: bool) -> Any:
    """DCP's DefaultStager as torchtitan configures it (``async_with_pinned_mem``), minus what needs CUDA.

    Pinned memory and non-blocking copies assert on a CPU-only machine; shared memory is what
    the process-based checkpointer hands its worker the staged tensors in. ``sharded``
    (TorchRec's ShardedTensors): DefaultStager's copier calls ``data_ptr()`` on them, which
    ShardedTensor does not support (torch 2.13), so it cannot stage them at all; what DCP offers
    that can is ``BlockingAsyncStager(cache_staged_state_dict=True)``: CPU buffers made once and
    reused, filled on the training thread. Its buffers are pinned, which needs CUDA; here the
    same without pinning.
    """
    from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions

    if not sharded:
        return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=process, use_async_staging=True,
                                            use_non_blocking_copy=False))

    class ReusedBuffers(BlockingAsyncStager):
        def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

            if self.state_dict_cache is None:
                self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            return _copy_state_dict(state_dict, self.state_dict_cache)

    return ReusedBuffers(cache_staged_state_dict=True)


class Saver:
    """start(trainer): the blocking part; ready(): before the next mutation; done(); finish(): durable.

    Retention is the same for every method: after a save is durable, the one before it is
    deleted, so every method writes next to one earlier checkpoint. Ours (``keep_last_n=1``)
    and the DCP methods (as torchtitan purges) delete it in a background thread; the
    synchronous and Lightning-IO methods on the training thread when the save is seen
    complete, as Lightning's ModelCheckpoint deletes, and that time is part of their cost.
    """

    def __init__(self, method: str, root: Path, single_process: bool) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.method, self.root, self.n = method, root, 0
        self.purger = ThreadPoolExecutor(1, thread_name_prefix="purge") if method in DCP_METHODS else None
        self.purged: Any = None
        self.group: Any = None
        self.future: Any = None
        self.staging: Any = None
        self.waited = 0.0  # seconds ready() blocked the training thread for the save in flight
        self.async_checkpoint: Any = None
        self.snapshot: Any = None
        self.kept: Path | None = None  # the newest save of a baseline, and the one before it (deleted once durable)
        self.previous: Path | None = None
        self.sharded = not single_process
        if method in ("dcp_async_stager", "dcp_async_process"):
            self.stager = _stager(process=method == "dcp_async_process", sharded=self.sharded)
        if method == "dcp_async_process" and single_process and not dist.is_initialized():
            # the process-based checkpointer needs a process group, even of one (ETTStrategy makes its own)
            from lightning.fabric.plugins.environments.lightning import find_free_network_port

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_network_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
        if method == "ours":
            from lightning_ett import AsyncCheckpoint

            self.async_checkpoint = AsyncCheckpoint(root, every_n_train_steps=10**9, keep_last_n=1,
                                                    save_on_train_end=False, resume=False)

    def dcp_group(self) -> Any:
        """Multi-rank: a gloo group of its own for the background writes, as torchtitan makes one (the default
        group's collectives, issued by training on the main thread, would interleave with the writer's)."""
        if self.group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo")
        return self.group

    def start(self, trainer: Trainer) -> None:
        import torch.distributed.checkpoint as dcp

        self.n += 1
        self.waited = 0.0
        self.trainer_strategy = trainer.strategy
        path = self.root / f"save{self.n}"
        if self.method in ("torch_save", "sync_dcp"):
            trainer.save_checkpoint(path)  # ETTStrategy: its synchronous sharded DCP write
        elif self.method == "lightning_async":
            trainer.save_checkpoint(path)
            self.future = trainer.strategy.checkpoint_io._executor.submit(lambda: None)  # FIFO: done after the save
        elif self.method == "dcp_async_default":
            # Sharded: DCP's default stager cannot copy ShardedTensors (see _stager); the stager async_save
            # used before it, a fresh CPU copy per call on the training thread, can.
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            stager = BlockingAsyncStager() if self.sharded else None
            self.future = dcp.async_save(_dcp_state(trainer), checkpoint_id=str(path), async_stager=stager,
                                         process_group=self.dcp_group())
        elif self.method in ("dcp_async_stager", "dcp_async_process"):
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            kind = AsyncCheckpointerType.PROCESS if self.method == "dcp_async_process" else AsyncCheckpointerType.THREAD
            response = dcp.async_save(_dcp_state(trainer), checkpoint_id=str(path),
                                      async_stager=self.stager, async_checkpointer_type=kind, process_group=self.dcp_group())
            if hasattr(response, "staging_completion"):  # staged in the background
                self.staging, self.future = response.staging_completion, response.upload_completion
            else:  # staged on the training thread (a blocking stager): only the upload is left
                self.future = response
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
            if self.purger is not None:  # DCP: every rank's part is durable once its future is done on every rank
                if self.purged is not None:
                    self.purged.result()  # surfaced, never swallowed
                if not dist.is_initialized() or dist.get_rank() == 0:
                    self.purged = self.purger.submit(shutil.rmtree, self.previous)
            elif self.method == "sync_dcp":
                self.trainer_strategy.remove_checkpoint(self.previous)  # rank 0 deletes, as ModelCheckpoint calls it
            else:
                shutil.rmtree(self.previous) if self.previous.is_dir() else self.previous.unlink()
            self.previous = None


class Driver(Callback):
    """warm-up -> save 0 (not measured) -> drain -> K x [baseline steps -> measured save -> drain] -> stop.

    Several measured saves in one process: the steady state of a job that checkpoints
    periodically (buffers warm, one earlier checkpoint on disk), and a median against noise.
    Every step ends with the ranks agreeing whether the write in flight is done (one scalar
    all-reduce, in every stage, so baseline and measured steps carry the same cost).
    """

    def __init__(self, saver: Saver, measured_saves: int, fused: bool, baseline_steps: int = 20) -> None:
        self.saver, self.measured_saves, self.baseline_steps, self.fused = saver, measured_saves, baseline_steps, fused
        self.stage, self.count, self.step_start = "warmup", 0, 0.0
        self.baseline: list[float] = []
        self.during: list[float] = []
        self.blocked = 0.0
        self.write_started = 0.0
        self.results: list[dict[str, float]] = []
        self.staging_bytes: int | None = None

    def on_before_backward(self, trainer, *args):  # type: ignore[no-untyped-def]
        if self.fused:  # TorchRec's fused optimizer updates the tables inside backward
            self.saver.ready()

    def on_before_optimizer_step(self, trainer, *args):  # type: ignore[no-untyped-def]
        self.saver.ready()

    def on_train_batch_start(self, trainer, *args):  # type: ignore[no-untyped-def]
        self.step_start = time.perf_counter()

    def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def]
        done = agree(self.saver.done())
        step_s = time.perf_counter() - self.step_start
        self.count += 1
        if self.stage == "warmup" and self.count >= 5:
            self.saver.start(trainer)
            self.stage, self.count = "drain", 0
        elif self.stage == "drain":
            if done and self.count >= 3:
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
            if done:
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
    p.add_argument("--model", choices=tuple(METHODS), default="embedding")
    p.add_argument("--method", required=True)
    p.add_argument("--gib", type=float, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--saves", type=int, default=5, help="measured saves (after one warm-up save)")
    p.add_argument("--phases", choices=checkpoint_writer_phases.SWITCHES, default=None,
                   help="ours only: time the writer's phases (checkpoint_writer_phases.py)")
    args = p.parse_args()
    if args.method not in METHODS[args.model]:
        p.error(f"--method {args.method}: the {args.model} model's methods are {', '.join(METHODS[args.model])}")
    if args.phases is not None:
        if args.method != "ours":
            p.error(f"--phases {args.phases}: only --method ours has a writer whose phases can be timed")
        checkpoint_writer_phases.install(args.phases)
    root = Path(args.dir)
    torch.manual_seed(0)
    saver = Saver(args.method, root, single_process=args.model == "embedding")
    driver = Driver(saver, args.saves, fused=args.model == "ett")
    callbacks: list[Callback] = [driver] + ([saver.async_checkpoint] if saver.async_checkpoint is not None else [])
    plugins = []
    if args.method == "lightning_async":
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        plugins.append(AsyncCheckpointIO())
    if args.model == "ett":
        from lightning_ett import ETTStrategy

        model: LightningModule = ShardedState(args.gib)
        strategy: Any = ETTStrategy(sharding_type="table_wise", fused_optimizer="row_wise_adagrad")
        devices = 2
    else:
        model, strategy, devices = BigState(args.gib), "auto", 1
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=100_000, callbacks=callbacks,
                      plugins=plugins, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=args.method == "ours", limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(Steps(), batch_size=None))
    medians = {k: statistics.median(r[k] for r in driver.results) for k in driver.results[0]}
    out = Path(args.out) if trainer.global_rank == 0 else Path(f"{args.out}.{trainer.global_rank}")
    out.write_text(json.dumps({"method": args.method, "gib": args.gib, "rank": trainer.global_rank, **medians,
                               "saves": driver.results, "staging_bytes": driver.staging_bytes,
                               "phases": checkpoint_writer_phases.report()}))


if __name__ == "__main__":
    main()
