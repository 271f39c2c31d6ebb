"""The example DLRM (examples/dlrm_example.py) on 4 real gloo ranks, 1D and 2D, for tests/distributed/test_sparse_2d.py.

Several fits run one after the other in the same 4 processes (one process group, started once):
``--fits`` is a JSON list of ``{"name", "k", "interval", "steps", "resume", "save", "digests"}``, and optionally
``"sharding_type"``, ``"min_partition"`` (column-wise block, so that 8-dim tables split in columns), ``"accumulate"``,
``"save_mid_at"`` (a ``trainer.save_checkpoint`` after that micro-batch, the state then recorded as ``mid``),
``"sigterm_at"`` (rank 0 SIGTERMs itself in that micro-batch, stopped by Lightning's per-batch check as on NCCL;
AsyncCheckpoint saves on the way out), ``"val_every"`` (validation every that many batches, recording each rank's
table digest as validation sees it), ``"lr"``, ``"lr_scale"`` (``replica_lr_scale``), ``"init_seed"`` (the model's
initialization) and ``"data_seed"`` (benchmarks/sparse_2d_lr.py varies both); with
``"expect_error"`` a ConfigurationError is recorded, not raised; ``"manual"``: manual optimization with a plain
``loss.backward()``.
Batches are made from (global step, micro-batch, rank) and learnable (the label depends on a dense feature
and on the parity of the first id), so a resumed fit sees the data an uninterrupted one saw.
Each fit writes OUT/<name>/rank<r>.pt: losses, the held-out loss, every tensor this rank holds
(model and fused optimizer state, sharded tables by shard offset) at the start and at the end,
and with ``digests`` a hash of those tensors after every step.

``--launcher`` mode is one fit under ``lightning run``: AsyncCheckpoint, ModelPublisher and
ETTMonitor, and rank 1 SIGKILLs itself once at ``--kill-at`` on the first attempt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, IterableDataset
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.distributed.planner import ParameterConstraints
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from examples.dlrm_example import DLRMModule
from lightning_ett import AsyncCheckpoint, ETTMonitor, ETTStrategy, ModelPublisher
from lightning_ett.durable.errors import ConfigurationError
from lightning_ett.strategies import sigterm
from lightning_ett.strategies.replica_sync import table_kernels

ROWS, DIM, BATCH = 500, 8, 32
EVAL_STEP = 99_999  # batches from here on are never trained on


DATA_SEED = 0


def make_batch(step: int, rank: int, micro: int = 0) -> Batch:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank + 10**9 * DATA_SEED)
    dense = torch.randn(BATCH, len(DEFAULT_INT_NAMES), generator=g)
    ids = torch.randint(0, ROWS, (len(DEFAULT_CAT_NAMES), BATCH), generator=g)
    labels = ((dense[:, 0] + (ids[0] % 2).float() * 2 - 1) > 0).long()
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=DEFAULT_CAT_NAMES, values=ids.reshape(-1),
                                              lengths=torch.ones(len(DEFAULT_CAT_NAMES) * BATCH, dtype=torch.int32))
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


class Steps(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            yield 0  # the module makes the batch from the step: the same data after a resume


class StepBatchDLRM(DLRMModule):
    """The example's module, fed by the step-keyed batches."""

    kill_at: int | None = None
    sigterm_at: int | None = None

    def __init__(self) -> None:
        super().__init__(num_embeddings=ROWS, embedding_dim=DIM, dense_arch_layer_sizes=[16, DIM],
                         over_arch_layer_sizes=[16, 1], learning_rate=0.05)
        self.losses: list[float] = []
        self.validated: list[tuple[int, str]] = []

    def training_step(self, _batch: Any, batch_idx: int) -> torch.Tensor:
        if self.kill_at == self.global_step and self.global_rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.sigterm_at == batch_idx and self.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        micro = batch_idx % self.trainer.accumulate_grad_batches
        loss = super().training_step(make_batch(self.global_step, self.global_rank, micro), batch_idx)
        self.losses.append(float(loss.detach()))
        if not self.automatic_optimization:  # a plain backward, which Lightning does not see
            optimizer = self.optimizers()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return loss

    def validation_step(self, _batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:  # after every start-of-validation hook: the tables as validation sees them
            self.validated.append((self.global_step, digest(held_state(self.trainer))))
        super().validation_step(make_batch(EVAL_STEP, self.global_rank), batch_idx)

    def held_out_loss(self) -> float:
        """Mean BCE on 4 unseen batches per rank, averaged over ranks (a collective forward on every rank)."""
        with torch.no_grad():
            losses = [self.loss(self(b), b.labels.float()) for b in (make_batch(EVAL_STEP + i, self.global_rank)
                                                                      for i in range(4))]
        mean = torch.stack(losses).mean().double()
        dist.all_reduce(mean)
        return float(mean) / dist.get_world_size()


def local_tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor this rank holds in ``state``: sharded ones per shard, keyed ``name@offsets``."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for key, value in state.items():
            out.update(local_tensors(value, f"{prefix}{key}."))
        return out
    name = prefix[:-1]
    if isinstance(state, ShardedTensor):
        for shard in state.local_shards():
            out[f"{name}@{tuple(shard.metadata.shard_offsets)}"] = shard.tensor.detach().clone()
    elif isinstance(state, DTensor):
        local = state._local_tensor
        if hasattr(local, "local_shards"):  # TorchRec's LocalShardsWrapper
            for tensor, offsets in zip(local.local_shards(), local.local_offsets()):
                out[f"{name}@{tuple(offsets)}"] = tensor.detach().clone()
        else:
            out[name] = local.detach().clone()
    elif isinstance(state, torch.Tensor):
        out[name] = state.detach().clone()
    return out


def held_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Model, fused optimizer state and (``dense_opt.``) the configure_optimizers optimizer's state by parameter name:
    data-parallel tables are trained by the latter."""
    state = local_tensors(trainer.strategy.model.state_dict(), "model.")
    fused = trainer.strategy.fused_optimizer_instance
    if fused is not None:
        state.update(local_tensors(fused.state_dict()["state"], "fused."))
    names = {id(p): n for n, p in trainer.lightning_module.named_parameters()}
    for optimizer in trainer.optimizers:
        for param, values in optimizer.state.items():
            state.update(local_tensors(values, f"dense_opt.{names[id(param)]}."))
    return state


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha1()
    for key in sorted(k for k in state if "embedding_bags" in k and not k.endswith(".step")):  # tables, their optimizer state
        h.update(key.encode())
        h.update(state[key].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Record(Callback):
    """What the tests compare: the state right after set-up/restore, after each step (digests), at the end."""

    def __init__(self, digests: bool) -> None:
        self.digests = digests
        self.start: dict[str, torch.Tensor] = {}
        self.steps: list[tuple[int, str]] = []
        self.save_mid: tuple[int, Path] | None = None
        self.mid: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.start = held_state(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.digests:
            self.steps.append((trainer.global_step, digest(held_state(trainer))))
        if self.save_mid is not None and batch_idx == self.save_mid[0]:
            trainer.save_checkpoint(self.save_mid[1])  # between micro-batches, as a time-based or user save can be
            self.mid = held_state(trainer)


def run_fit(spec: dict[str, Any], out: Path, devices: int, launcher: dict[str, Any] | None) -> None:
    global DATA_SEED
    DATA_SEED = spec.get("data_seed", 0)
    seed_everything(spec.get("init_seed", 0), workers=False, verbose=False)
    sharding_type = spec.get("sharding_type", "table_wise")
    constraints = {f"t_{name}": ParameterConstraints(sharding_types=[sharding_type], min_partition=spec["min_partition"])
                   for name in DEFAULT_CAT_NAMES} if spec.get("min_partition") else None
    strategy = ETTStrategy(sharding_type=sharding_type, constraints=constraints, sharding_group_size=spec.get("k"),
                           replica_sync_every_n_steps=spec.get("interval", 1),
                           fused_optimizer=spec.get("fused_optimizer", "row_wise_adagrad"),
                           fused_optimizer_kwargs={"lr": spec.get("lr", 0.05)},
                           replica_lr_scale=spec.get("lr_scale", 1.0))
    record = Record(bool(spec.get("digests")))
    if spec.get("save_mid_at") is not None:
        record.save_mid = (spec["save_mid_at"], out / spec["name"] / "mid")
    callbacks: list[Callback] = [record]
    if launcher is not None:
        callbacks += [ETTMonitor(), AsyncCheckpoint(launcher["ckpt_dir"], every_n_train_steps=launcher["every"], keep_last_n=2),
                      ModelPublisher(launcher["publish_dir"], submodule="model", metrics=["loss"], strict=True)]
    if spec.get("sigterm_at") is not None:  # only the save on the way out
        callbacks.append(AsyncCheckpoint(out / spec["name"] / "async", every_n_train_steps=10_000))
        # Lightning's own check, every batch (as on NCCL), instead of ETTStrategy's every 8th on gloo:
        # the stop then falls between micro-batches. (Restored after this fit.)
        sigterm.DeferredSigtermBroadcast.__init__.__defaults__ = (1,)
    val_every = spec.get("val_every")
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=spec["steps"], logger=False,
                      callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=1 if val_every else 0, val_check_interval=val_every, check_val_every_n_epoch=None,
                      num_sanity_val_steps=0, enable_checkpointing=launcher is not None or spec.get("sigterm_at") is not None,
                      accumulate_grad_batches=spec.get("accumulate", 1))
    model = StepBatchDLRM()
    model.kill_at, model.sigterm_at = spec.get("kill_at"), spec.get("sigterm_at")
    resume = str(out / spec["resume"] / "ckpt") if spec.get("resume") else None
    if spec.get("resume_dir"):  # a checkpoint elsewhere under OUT (a mid-accumulation save)
        resume = str(out / spec["resume_dir"])
    loader = DataLoader(Steps(), batch_size=None)
    model.automatic_optimization = not spec.get("manual")
    try:
        trainer.fit(model, loader, val_dataloaders=DataLoader(Steps(), batch_size=None) if val_every else None,
                    ckpt_path=resume)
    except SIGTERMException:
        pass  # the facts below record where it stopped
    except ConfigurationError as e:  # refused: every rank raises it, before or at the restore
        if not spec.get("expect_error"):
            raise
        (out / spec["name"]).mkdir(parents=True, exist_ok=True)
        torch.save({"error": str(e)}, out / spec["name"] / f"rank{trainer.global_rank}.pt")
        return
    finally:
        sigterm.DeferredSigtermBroadcast.__init__.__defaults__ = (8,)
    if spec.get("save"):
        trainer.save_checkpoint(out / spec["name"] / "ckpt")
    facts = {
        "losses": model.losses, "held_out_loss": model.held_out_loss(), "global_step": trainer.global_step,
        "start": record.start, "end": held_state(trainer), "digests": record.steps, "plan": str(strategy.plan),
        "mid": record.mid, "validated": model.validated, "batches": len(model.losses),
        "table_lr": sorted({kernel.get_learning_rate() for kernel in table_kernels(strategy.model)}),
        "replica_syncs": strategy.replica_sync.syncs if strategy.replica_sync is not None else 0,
        "replica_sync_bytes": strategy.replica_sync.nbytes if strategy.replica_sync is not None else 0,
    }
    (out / spec["name"]).mkdir(parents=True, exist_ok=True)
    torch.save(facts, out / spec["name"] / f"rank{trainer.global_rank}.pt")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--fits", required=True, help="JSON list of fits (see the module docstring)")
    p.add_argument("--launcher", default=None, help='JSON {"ckpt_dir", "every", "publish_dir"}: lightning run mode')
    args = p.parse_args()
    launcher = json.loads(args.launcher) if args.launcher else None
    for spec in json.loads(args.fits):
        run_fit(spec, args.out, args.devices, launcher)


if __name__ == "__main__":
    main()
