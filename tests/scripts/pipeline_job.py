"""The example DLRM fed by a real data loader, pipelined and not, for tests/distributed/test_input_pipeline.py.

Several fits run one after the other in the same processes: ``--fits`` is a JSON list of
``{"name", "pipeline", "steps"}`` and optionally ``"k"`` (2D group size), ``"accumulate"``,
``"val_every"`` (validation every that many batches, 2 batches), ``"manual"`` (manual optimization with
``manual_backward``), ``"finite"`` (a sized, map-style loader of that many samples per rank in batches of
16, so the last batch of each epoch is short; ``"epochs"`` of it), ``"save_at"`` (``trainer.save_checkpoint``
after that batch), ``"resume"`` (the fit whose save to resume from), ``"sharding_type"``, ``"precision"``,
``"callbacks"`` (ETTMonitor, AsyncCheckpoint every 10 steps, DynamicShapes and CompileCache, the dense
parts compiled with ``aot_eager``), ``"resume_path"`` (a checkpoint under OUT to resume from),
``"variant"``: ``"rebuilt_kjt"`` (forward hands the tables a KJT it builds, so nothing can be distributed
ahead), ``"before_transfer"`` (an ``on_before_batch_transfer`` hook), ``"dataloader_iter"``
(``training_step(dataloader_iter)``), ``"after_transfer_step"`` (an ``on_after_batch_transfer`` that scales the
dense features by the global step), ``"inplace_ids"`` (``training_step`` folds the ids in place),
``"rank1_rebuilds"`` (rank 1's forward hands the tables a KJT it builds, rank 0 the batch's) or
``"stateful_sized"`` (the finite loader with a ``state_dict``) or ``"position_weighted"`` (the tables in a
FeatureProcessedEmbeddingBagCollection); ``"none_at"``: the stream yields None
there; ``"expect_error"``: a ConfigurationError is recorded, not raised; ``"gc_freeze"``: ETTStrategy's (default
True). Each fit also records how many objects ``gc.freeze`` held at its training batches (fewest, most), when
the strategy's ``teardown`` began, and after the fit.

The unsized loader is stateful: its state is the number of batches the loop has processed, so a fit
resumed from a checkpoint reads the batches an uninterrupted one read after that point. Each fit writes
OUT/<name>/rank<r>.pt: losses, every tensor this rank holds at the end, and the pipeline's counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparse_2d_job import held_state

from examples.dlrm_example import DLRMModule
from lightning_ett import AsyncCheckpoint, CompileCache, DynamicShapes, ETTMonitor, ETTStrategy
from lightning_ett.durable.errors import ConfigurationError
from lightning_ett.instrument.compile_events import compile_tracker

ROWS, DIM, BATCH = 500, 8, 32


def make_rows(keys: list[int], rank: int) -> Batch:
    """One batch whose sample j is drawn from (key j, rank) alone, so any split of keys into batches is reproducible."""
    dense, ids = [], []
    for key in keys:
        g = torch.Generator().manual_seed(7919 * key + rank)
        dense.append(torch.randn(len(DEFAULT_INT_NAMES), generator=g))
        ids.append(torch.randint(0, ROWS, (len(DEFAULT_CAT_NAMES),), generator=g))
    dense_t, ids_t = torch.stack(dense), torch.stack(ids).t()  # ids: feature-major, as a KJT holds them
    labels = ((dense_t[:, 0] + (ids_t[0] % 2).float() * 2 - 1) > 0).long()
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=DEFAULT_CAT_NAMES, values=ids_t.reshape(-1),
                                              lengths=torch.ones(len(DEFAULT_CAT_NAMES) * len(keys), dtype=torch.int32))
    return Batch(dense_features=dense_t, sparse_features=kjt, labels=labels)


class Stream(IterableDataset):
    """Unsized: batch n holds keys n*BATCH .. (n+1)*BATCH-1, from batch ``start`` on."""

    def __init__(self, rank: int, offset: int = 0, none_at: int | None = None) -> None:
        self.rank, self.offset, self.start, self.none_at = rank, offset, 0, none_at

    def __iter__(self):  # type: ignore[no-untyped-def]
        n = self.start
        while True:
            yield None if n == self.none_at else make_rows(list(range(self.offset + n * BATCH, self.offset + (n + 1) * BATCH)),
                                                           self.rank)
            n += 1


class ResumableLoader(DataLoader):
    """Stateful as Lightning sees it (``state_dict``/``load_state_dict``): resumes at the batch the loop
    processes next, whatever was read ahead."""

    trainer: Trainer | None = None

    def state_dict(self) -> dict[str, int]:
        assert self.trainer is not None
        return {"next": self.trainer.fit_loop.epoch_loop.batch_progress.current.processed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.dataset.start = state["next"]


class Samples(Dataset):
    """Sized, map-style: Lightning adds a DistributedSampler; the collate makes the Batch."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class PipelinedDLRM(DLRMModule):
    def __init__(self, compiled: bool = False) -> None:
        super().__init__(num_embeddings=ROWS, embedding_dim=DIM, dense_arch_layer_sizes=[16, DIM],
                         over_arch_layer_sizes=[16, 1], learning_rate=0.05)
        if compiled:  # as compile_dense does, with a backend that needs no C++ compiler
            for dense_part in (self.model.dense_arch, self.model.inter_arch, self.model.over_arch):
                dense_part.compile(backend="aot_eager")
        self.losses: list[float] = []
        self.batch_sizes: list[int] = []

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self.loss(self(batch), batch.labels.float())
        self.log("train/loss", loss, batch_size=batch.labels.numel())
        self.losses.append(float(loss.detach()))
        self.batch_sizes.append(batch.labels.numel())
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.loss(self(batch), batch.labels.float())


class RebuiltKJT(PipelinedDLRM):
    """Hands the tables a KJT made in forward: not an object of the batch."""

    def forward(self, batch: Batch) -> torch.Tensor:
        kjt = batch.sparse_features
        rebuilt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths())
        return self.model(batch.dense_features, rebuilt).squeeze(-1)


class BeforeTransfer(PipelinedDLRM):
    def on_before_batch_transfer(self, batch: Batch, dataloader_idx: int) -> Batch:
        return batch


class DataloaderIter(PipelinedDLRM):
    def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
        batch, _, _ = next(dataloader_iter)
        batch = self.trainer.strategy.batch_to_device(batch)
        return super().training_step(batch, 0)


class AfterTransferStep(PipelinedDLRM):
    """A curriculum in on_after_batch_transfer: it must see the step of the batch it transfers."""

    def on_after_batch_transfer(self, batch: Batch, dataloader_idx: int) -> Batch:
        scale = 1.0 + 0.1 * self.trainer.global_step
        return Batch(dense_features=batch.dense_features * scale, sparse_features=batch.sparse_features,
                     labels=batch.labels)


class InplaceIds(PipelinedDLRM):
    """Folds the ids into range in place before the lookup (a no-op on these ids, but an edit in place)."""

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        batch.sparse_features.values().remainder_(ROWS)
        return super().training_step(batch, batch_idx)


class Rank1Rebuilds(RebuiltKJT):
    """Rank 1 hands the tables a KJT it builds; rank 0 the batch's own."""

    def forward(self, batch: Batch) -> torch.Tensor:
        if self.global_rank == 1:
            return super().forward(batch)
        return PipelinedDLRM.forward(self, batch)


class StatefulLoader(DataLoader):
    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


class PositionWeighted(PipelinedDLRM):
    """The tables behind TorchRec's FeatureProcessedEmbeddingBagCollection (position weights): sharded row-wise, its
    input_dist fills the KJT's weights in place before sending them, as it does unpipelined."""

    def __init__(self, compiled: bool = False) -> None:
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
        from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

        super().__init__(compiled)
        sparse = self.model.sparse_arch
        plain = sparse.embedding_bag_collection
        weighted = EmbeddingBagCollection(plain.embedding_bag_configs(), is_weighted=True, device=plain.device)
        sparse.embedding_bag_collection = FeatureProcessedEmbeddingBagCollection(
            weighted, PositionWeightedModuleCollection({f: 1 for f in DEFAULT_CAT_NAMES}))


VARIANTS = {None: PipelinedDLRM, "position_weighted": PositionWeighted, "after_transfer_step": AfterTransferStep,
            "inplace_ids": InplaceIds,
            "rank1_rebuilds": Rank1Rebuilds, "stateful_sized": PipelinedDLRM, "rebuilt_kjt": RebuiltKJT,
            "before_transfer": BeforeTransfer,
            "dataloader_iter": DataloaderIter}


class SaveAt(Callback):
    def __init__(self, at: int, path: Path) -> None:
        self.at, self.path = at, path

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at:
            trainer.save_checkpoint(self.path)


class FrozenSeen(Callback):
    """``gc.get_freeze_count()`` at each training batch: the fewest and the most seen."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.counts.append(gc.get_freeze_count())


class FreezeAtTeardown(ETTStrategy):
    """``gc.get_freeze_count()`` when ``teardown`` begins: still frozen after a fit that ended (the fit loop may run
    again inside a fit), unfrozen already after one that failed (``on_exception``)."""

    at_teardown: int | None = None

    def teardown(self) -> None:
        self.at_teardown = gc.get_freeze_count()
        super().teardown()


def run_fit(spec: dict[str, Any], out: Path, devices: int) -> None:
    seed_everything(0, workers=False, verbose=False)
    strategy = FreezeAtTeardown(sharding_type=spec.get("sharding_type", "table_wise"), sharding_group_size=spec.get("k"),
                           fused_optimizer="row_wise_adagrad", fused_optimizer_kwargs={"lr": 0.05},
                           pipeline=spec["pipeline"], gc_freeze=spec.get("gc_freeze", True))
    frozen = FrozenSeen()
    callbacks: list[Callback] = [frozen]
    if spec.get("save_at") is not None:
        callbacks.append(SaveAt(spec["save_at"], out / spec["name"] / "ckpt"))
    if spec.get("callbacks"):
        callbacks += [ETTMonitor(report_on_end=False),  # the ledger of `lightning run`'s run directory
                      AsyncCheckpoint(out / spec["name"] / "async", every_n_train_steps=10, keep_last_n=5, when_busy="wait"),
                      DynamicShapes(), CompileCache(out / spec["name"] / "compile-cache")]
    val_every = spec.get("val_every")
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, callbacks=callbacks,
                      max_steps=spec.get("steps", -1), max_epochs=spec.get("epochs", 1 if spec.get("finite") else None),
                      enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=bool(spec.get("callbacks")),
                      limit_val_batches=2 if val_every else 0, val_check_interval=val_every,
                      check_val_every_n_epoch=None if val_every else 1, num_sanity_val_steps=0,
                      accumulate_grad_batches=spec.get("accumulate", 1), precision=spec.get("precision", "32-true"))
    model = VARIANTS[spec.get("variant")](compiled=bool(spec.get("callbacks")))
    model.automatic_optimization = not spec.get("manual")
    rank = trainer.global_rank
    if spec.get("finite"):
        kind = StatefulLoader if spec.get("variant") == "stateful_sized" else DataLoader
        loader: DataLoader = kind(Samples(spec["finite"] * devices), batch_size=16,
                                  collate_fn=lambda keys: make_rows(keys, 0))
    else:
        loader = ResumableLoader(Stream(rank, none_at=spec.get("none_at")), batch_size=None)
        loader.trainer = trainer
    val = DataLoader(Stream(rank, offset=10**6), batch_size=None) if val_every else None
    resume = str(out / spec["resume"] / "ckpt") if spec.get("resume") else None
    if spec.get("resume_path"):
        resume = str(out / spec["resume_path"])
    torch._dynamo.reset()  # each fit compiles afresh: its recompiles are its own
    recompiles_before = compile_tracker().recompiles
    error = None
    try:
        trainer.fit(model, loader, val_dataloaders=val, ckpt_path=resume)
    except ConfigurationError as e:
        if not spec.get("expect_error"):
            raise
        error = str(e)
    pipeline = strategy.input_pipeline
    facts = {
        "losses": model.losses, "batch_sizes": model.batch_sizes, "end": held_state(trainer),
        "global_step": trainer.global_step, "recompiles": compile_tracker().recompiles - recompiles_before,
        "pipelined_calls": pipeline.pipelined_calls if pipeline is not None else 0,
        "prepared_batches": pipeline.prepared_batches if pipeline is not None else 0,
        "off_reason": pipeline.off_reason if pipeline is not None else None, "error": error,
        "frozen_in_training": (min(frozen.counts), max(frozen.counts)) if frozen.counts else None,
        "frozen_at_teardown": strategy.at_teardown, "frozen_after": gc.get_freeze_count(),
    }
    (out / spec["name"]).mkdir(parents=True, exist_ok=True)
    torch.save(facts, out / spec["name"] / f"rank{rank}.pt")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--fits", required=True, help="JSON list of fits (see the module docstring)")
    args = p.parse_args()
    for spec in json.loads(args.fits):
        run_fit(spec, args.out, args.devices)


if __name__ == "__main__":
    main()
