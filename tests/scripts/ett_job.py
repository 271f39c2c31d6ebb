"""A sharded DLRM job under ETTStrategy, for the multi-rank tests (real gloo ranks).

Batches are generated from (global step, rank), so a resumed run sees the same data as an
uninterrupted one. At the end every rank writes its local view of the model and fused
optimizer state, its losses and the strategy's plan source to OUT/rank<r>.pt.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.utils.data import DataLoader, IterableDataset
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_ett import AsyncCheckpoint, ETTMonitor, ETTStrategy, ModelPublisher

KEYS = [f"f{i}" for i in range(4)]
DENSE = 8
EVAL_STEP = 99_999  # batches of this step are never trained on


def make_batch(step: int, rank: int, batch: int, rows: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    dense = torch.randn(batch, DENSE, generator=g)
    ids = torch.randint(0, rows, (len(KEYS), batch), generator=g)
    # Learnable: the label depends on a dense feature and on the parity of the first id.
    labels = ((dense[:, 0] + (ids[0] % 2).float() * 2 - 1) > 0).float()
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=ids.reshape(-1),
                                              lengths=torch.ones(len(KEYS) * batch, dtype=torch.int32))
    return dense, kjt, labels


class Steps(IterableDataset):
    def __len__(self) -> int:
        return 10_000

    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            yield 0  # the module makes the batch from the step: same data after a resume


class ShardedDLRM(LightningModule):
    def __init__(self, rows: int, batch: int, build_in_setup: bool = False, batchnorm: bool = False) -> None:
        super().__init__()
        self.rows, self.batch = rows, batch
        # Running statistics each rank updates from its own batch (TorchRec's DDP does not broadcast buffers).
        self.bn = torch.nn.BatchNorm1d(DENSE, affine=False) if batchnorm else None  # buffers only: no new parameter
        self.dlrm: DLRM | None = None
        if not build_in_setup:
            self.build()
        self.losses: list[float] = []

    def setup(self, stage: str) -> None:
        if self.dlrm is None:
            self.build()  # tables that exist only after ETTStrategy's overlap window

    def build(self) -> None:
        tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=self.embedding_dim, num_embeddings=self.rows,
                                     feature_names=[k])
                  for i, k in enumerate(KEYS)]
        torch.manual_seed(0)
        self.dlrm = DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            dense_in_features=DENSE, dense_arch_layer_sizes=[16, self.embedding_dim], over_arch_layer_sizes=[16, 1],
        )

    embedding_dim = 8  # every table's (set on the class before construction: the tables are built in __init__)
    sigterm_at: int | None = None
    kill_at: int | None = None
    kill_rank = 1
    kill_when_writing = False
    log_loss = False
    fail_at: int | None = None
    step_sleep = 0.0
    dense_optimizer = "adam"

    def kill_due(self) -> bool:
        """At ``kill_at`` on ``kill_rank``; with ``kill_when_writing``, at the first step from then on at which this
        rank's AsyncCheckpoint has a save in flight after one committed, with its rows on disk (a slow host may
        finish a save before a fixed step, still be writing the first, full one, or still be comparing rows)."""
        if self.kill_at is None or self.global_rank != self.kill_rank or self.global_step < self.kill_at:
            return False
        if not self.kill_when_writing:
            return self.global_step == self.kill_at
        return any(isinstance(c, AsyncCheckpoint) and c._writer is not None and c._writer.busy
                   and any(not p.name.endswith(".tmp") for p in Path(c.dirpath).glob("step-*"))  # a delta, then
                   and any(Path(c.dirpath).glob("step-*.tmp/delta-rank*"))  # its rows written, its commit not yet
                   for c in self.trainer.callbacks)

    def training_step(self, _batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.kill_due() and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            import signal

            os.kill(os.getpid(), signal.SIGKILL)  # a crash on the first attempt only
        if self.sigterm_at == self.global_step and self.global_rank == 0:
            import signal

            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler's preemption sends
        if self.step_sleep:
            import time

            time.sleep(self.step_sleep)
        if self.fail_at == self.global_step:
            raise RuntimeError(f"planted bug at step {self.global_step}")
        dense, kjt, labels = make_batch(self.global_step, self.global_rank, self.batch, self.rows)
        if self.bn is not None:
            dense = self.bn(dense)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.dlrm(dense, kjt).squeeze(-1), labels)
        self.losses.append(loss.item())
        if self.log_loss:
            self.log("loss", loss)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        # The natural code: the strategy routes the tables. Adagrad builds its state eagerly, Adam lazily.
        optimizer = (torch.optim.Adagrad if self.dense_optimizer == "adagrad" else torch.optim.Adam)(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SyncReference(Callback):
    """A synchronous save at the step boundary where AsyncCheckpoint snapshots: the state it must equal."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class BlockSave(Callback):
    """A file where the background write of ``step`` needs its directory: a real OS error on every rank."""

    def __init__(self, step: int, ckpt_dir: Path) -> None:
        self.step, self.ckpt_dir = step, ckpt_dir

    def on_train_batch_start(self, trainer, *args):  # type: ignore[no-untyped-def]
        if trainer.global_step == 1 and trainer.global_rank == 0:
            (self.ckpt_dir / f"step-{self.step:09d}.tmp").write_text("not a directory")


def local_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in module.state_dict().items():
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                out[f"{name}@{tuple(shard.metadata.shard_offsets)}"] = shard.tensor.detach().clone()
        elif isinstance(value, torch.Tensor):
            out[name] = value.detach().clone()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--sharding-type", default="table_wise")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--resume", default=None, help="a checkpoint, or 'last' (with --save-every: ModelCheckpoint's last)")
    p.add_argument("--plan-cache", default=None)
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--embedding-dim", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--sigterm-at", type=int, default=None)
    p.add_argument("--dense-optimizer", choices=["adam", "adagrad"], default="adam")
    p.add_argument("--kill-at", type=int, default=None, help="rank 1 SIGKILLs itself at this step of attempt 0")
    p.add_argument("--kill-rank", type=int, default=1, help="with --kill-at: the rank that dies")
    p.add_argument("--kill-when-writing", action="store_true",
                   help="with --kill-at: die at the first step from then on with a save in flight")
    p.add_argument("--build-in-setup", action="store_true", help="build the tables in LightningModule.setup()")
    p.add_argument("--rank1-sharding-type", default=None, help="give rank 1 other constraints (plan disagreement)")
    p.add_argument("--async-every", type=int, default=0, help="AsyncCheckpoint every N steps into --ckpt-dir")
    p.add_argument("--async-keep", type=int, default=3)
    p.add_argument("--incremental", action="store_true", help="AsyncCheckpoint(incremental=True)")
    p.add_argument("--when-busy", default="skip", help="AsyncCheckpoint(when_busy=...)")
    p.add_argument("--full-every", type=int, default=None, help="AsyncCheckpoint(full_every_n_saves=...)")
    p.add_argument("--chain-bound", type=float, default=None,
                   help="test only: chain.MAX_EXTRA_RESTORE and no fixed cost per delta, so that this small model's "
                        "chains reach their restore bound (and rebase); deltas always pay (save_kind), so the kinds "
                        "of saves do not depend on timing")
    p.add_argument("--fused-optimizer", default="row_wise_adagrad")
    p.add_argument("--sharding-group-size", type=int, default=None, help="2D: ETTStrategy(sharding_group_size=...)")
    p.add_argument("--async-minutes", type=float, default=None, help="AsyncCheckpoint every_n_minutes into --ckpt-dir")
    p.add_argument("--sync-ref-at", type=int, default=None,
                   help="also save synchronously (trainer.save_checkpoint) at this step, into OUT/ref")
    p.add_argument("--ett-from-env", action="store_true", help="ETTMonitor() takes its run dir from the launcher")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each training step sleeps")
    p.add_argument("--fail-at", type=int, default=None, help="raise in training_step at this step, on every attempt")
    p.add_argument("--top-k-dir", default=None,
                   help="also a stock ModelCheckpoint(monitor='loss', save_top_k=-1, every_n_train_steps=2) here")
    p.add_argument("--publish-dir", default=None, help="ModelPublisher(dirpath=..., submodule='dlrm')")
    p.add_argument("--publish-deltas", action="store_true", help="ModelPublisher(deltas=True, full_every_n_versions=10)")
    p.add_argument("--predict-out", default=None, help="after fit, each rank's predictions on an eval batch go here")
    p.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d on the dense features (per-rank buffers)")
    p.add_argument("--no-strict-loading", action="store_true", help="LightningModule.strict_loading = False")
    p.add_argument("--block-tmp-of", type=int, default=None, help="rank 0 puts a file where the save of this step writes")
    args = p.parse_args()

    out = Path(args.out)
    if args.chain_bound is not None:
        from lightning_ett.checkpoint import chain, save_kind

        chain.MAX_EXTRA_RESTORE, chain.DELTA_OPEN_BYTES_PER_RANK = args.chain_bound, 0
        save_kind.DELTA_COST_RATIO = float("inf")
    if args.rank1_sharding_type and int(os.environ.get("LOCAL_RANK", "0")) == 1:
        args.sharding_type = args.rank1_sharding_type
    strategy = ETTStrategy(sharding_type=args.sharding_type, plan_cache_dir=args.plan_cache,
                           fused_optimizer=args.fused_optimizer, fused_optimizer_kwargs={"lr": 0.05},
                           sharding_group_size=args.sharding_group_size)
    callbacks = [ETTMonitor() if args.ett_from_env else ETTMonitor(run_dir=out / "ett", report_on_end=False)]
    if args.save_every and args.resume == "last":  # the plain setup: one synchronous write per save, resume from it
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.save_every, save_top_k=1,
                                         save_last="link"))
    elif args.save_every:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.save_every, save_top_k=-1,
                                         filename="step{step}", auto_insert_metric_name=False))
    if args.async_every or args.async_minutes:
        interval = {"every_n_minutes": args.async_minutes} if args.async_minutes else {"every_n_train_steps": args.async_every}
        callbacks.append(AsyncCheckpoint(args.ckpt_dir, keep_last_n=args.async_keep, incremental=args.incremental,
                                         full_every_n_saves=args.full_every, when_busy=args.when_busy, verbose=True,
                                         **interval))
    if args.top_k_dir:  # its state in Lightning's checkpoint data grows a tensor at every save
        callbacks.append(ModelCheckpoint(dirpath=args.top_k_dir, monitor="loss", save_top_k=-1, every_n_train_steps=2))
    if args.publish_dir:
        callbacks.append(ModelPublisher(args.publish_dir, submodule="dlrm", metrics=["loss"], strict=True,
                                        deltas=args.publish_deltas,
                                        full_every_n_versions=10 if args.publish_deltas else None))
    if args.sync_ref_at is not None:
        callbacks.append(SyncReference(args.sync_ref_at, out / "ref"))
    if args.block_tmp_of is not None:
        callbacks.append(BlockSave(args.block_tmp_of, Path(args.ckpt_dir)))
    trainer = Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
                      max_steps=args.max_steps, logger=False,
                      callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      num_sanity_val_steps=0,
                      enable_checkpointing=bool(args.save_every or args.async_every or args.async_minutes),
                      gradient_clip_val=1.0)
    ShardedDLRM.embedding_dim = args.embedding_dim
    model = ShardedDLRM(args.rows, args.batch, build_in_setup=args.build_in_setup, batchnorm=args.batchnorm)
    model.sigterm_at = args.sigterm_at
    model.dense_optimizer = args.dense_optimizer
    model.kill_at = args.kill_at
    model.kill_rank = args.kill_rank
    model.kill_when_writing = args.kill_when_writing
    model.log_loss = args.top_k_dir is not None
    model.fail_at = args.fail_at
    model.step_sleep = args.step_sleep
    model.strict_loading = not args.no_strict_loading
    resume = args.resume
    if resume == "last" and not (Path(args.ckpt_dir) / "last.ckpt").exists():
        resume = None  # the first attempt: nothing saved yet
    trainer.fit(model, DataLoader(Steps(), batch_size=None), ckpt_path=resume)
    if args.predict_out:  # the sharded model's own predictions (a collective forward on every rank)
        dense, kjt, _ = make_batch(EVAL_STEP, trainer.global_rank, args.batch, args.rows)
        with torch.no_grad():
            predictions = model.dlrm(dense, kjt).squeeze(-1)
        Path(args.predict_out).mkdir(parents=True, exist_ok=True)
        torch.save({"dense": dense, "ids": kjt.values(), "lengths": kjt.lengths(), "predictions": predictions,
                    "global_step": trainer.global_step}, Path(args.predict_out) / f"rank{trainer.global_rank}.pt")
    fused = strategy.fused_optimizer_instance
    torch.save({
        "model": local_state(model),
        "fused": {k: v.detach().clone() for k, v in _flatten(fused.state_dict()["state"]).items()} if fused else {},
        "losses": model.losses,
        "global_step": trainer.global_step,
        "plan_source": strategy.plan_source,
        "plan": str(strategy.plan),
        "world_size": trainer.world_size,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "dense_optimizer_params": sum(len(g["params"]) for g in trainer.optimizers[0].param_groups),
        "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
    }, out / f"rank{trainer.global_rank}.pt")


def _flatten(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        elif isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                flat[f"{name}@{tuple(shard.metadata.shard_offsets)}"] = shard.tensor
        elif isinstance(value, torch.Tensor):
            flat[name] = value
    return flat


if __name__ == "__main__":
    main()
