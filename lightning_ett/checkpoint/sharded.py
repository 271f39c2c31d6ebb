"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory:

* DCP files for the model (sharded tables as ShardedTensors, dense tensors deduplicated)
  and the fused embedding optimizer's state; DCP reshards them on load, so a checkpoint
  written by N ranks loads on M.
* ``lightning.pt`` (rank 0): everything else Lightning puts in a checkpoint — loops,
  callbacks, schedulers — and the dense optimizers' state keyed by parameter name (dense
  parameters are replicated, so one copy serves any world size).

Saved through the same commit protocol as AsyncCheckpoint's (a manifest with checksums,
an atomic rename): a directory without a valid manifest is refused on load, naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_ett.checkpoint import chain, dcp_io
from lightning_ett.checkpoint.layout import commit_checkpoint, read_meta, require_complete
from lightning_ett.checkpoint.writer import CheckpointWriteError
from lightning_ett.durable.commit import discard_unfinished, temp_path
from lightning_ett.durable.errors import ConfigurationError, explain, root_cause
from lightning_ett.durable.files import remove_path

MODEL_KEY = "state_dict"
DENSE_KEY = "optimizer_states"
#: The fused (embedding) optimizer a checkpoint's ``fused`` state was saved with (``lightning.pt``): its state's
#: meaning is the optimizer's, which the state's keys and shapes do not tell apart (fbgemm calls Adam's first
#: moment and AdaGrad's sum both ``momentum1``, one value per element).
FUSED_NAME_KEY = "ett_fused_optimizer"


def _position_names(optimizer: Optimizer, names: dict[int, str]) -> list[str]:
    """Parameter names in the order ``optimizer.state_dict()`` numbers the parameters."""
    return [names[id(param)] for group in optimizer.param_groups for param in group["params"]]


def name_keyed_optimizer_state(optimizer: Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names instead of positions, so it survives re-wrapping."""
    state = optimizer.state_dict()
    index_to_name = dict(enumerate(_position_names(optimizer, names)))
    return {
        "state": {index_to_name[i]: s for i, s in state["state"].items()},
        "param_groups": [dict(g, params=[index_to_name[i] for i in g["params"]]) for g in state["param_groups"]],
    }


def load_name_keyed_optimizer_state(optimizer: Optimizer, saved: dict[str, Any], names: dict[int, str]) -> None:
    name_to_index = {name: index for index, name in enumerate(_position_names(optimizer, names))}
    missing = sorted(set(saved["state"]) - set(name_to_index))
    if missing:
        raise KeyError(f"Checkpointed optimizer state for parameters this optimizer does not hold: {missing[:5]}")
    optimizer.load_state_dict(
        {
            "state": {name_to_index[n]: s for n, s in saved["state"].items()},
            "param_groups": [dict(g, params=[name_to_index[n] for n in g["params"]]) for g in saved["param_groups"]],
        }
    )


def save_sharded(tensors: dict[str, Any], checkpoint: dict[str, Any], path: str | os.PathLike, rank: int,
                 broadcast: Callable[[Any], Any]) -> None:
    """Write ``tensors`` with DCP and ``checkpoint`` (the rest) as ``lightning.pt``, then commit (collective).

    Every rank writes its shards into ``<path>.tmp``; rank 0 writes ``lightning.pt`` and commits
    through the one protocol (:func:`lightning_ett.durable.commit.commit_directory`): fsync,
    manifest, rename, the old copy moved aside meanwhile. Rank 0's error, if any, is raised on
    every rank (a lone raise would leave the others waiting in the next collective).
    """
    final = Path(path).absolute()
    tmp = temp_path(final)
    error: str | None = None
    if rank == 0:
        try:
            remove_path(tmp)  # an unfinished save of the same name
        except OSError as e:
            error = explain(e, tmp)
    error = broadcast(error)  # (also the barrier: nobody writes before the old .tmp is gone)
    if error is not None:
        raise CheckpointWriteError(f"Preparing checkpoint {str(final)!r} failed on rank 0: {error}")
    try:
        dcp_io.write(tensors, tmp)
    except BaseException as e:
        said = explain(e, tmp)
        discard_unfinished(tmp)
        raise CheckpointWriteError(f"Writing checkpoint {str(final)!r} failed: {said}") from e
    if rank == 0:
        try:
            commit_checkpoint(tmp, final, checkpoint, int(checkpoint.get("global_step", 0)))
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = explain(e, tmp)
            discard_unfinished(tmp)
    error = broadcast(error)
    if error is not None:
        raise CheckpointWriteError(f"Committing checkpoint {str(final)!r} failed on rank 0: {error}")


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
    """``lightning.pt`` of a complete checkpoint, with the directory it came from (for the DCP loads)."""
    path = require_complete(path)
    meta = read_meta(path)
    meta["ett_checkpoint_dir"] = str(path)
    return meta


def load_model(path: str | os.PathLike, model: nn.Module, strict: bool = True) -> None:
    """Load the model's state from the checkpoint at ``path``. A checkpoint of another model (a table resized,
    a layer added) is a :class:`ConfigurationError`: it fails the same way on every attempt, so ``lightning run``
    does not retry it. ``strict=False`` (``LightningModule.strict_loading``): what the checkpoint lacks keeps
    its value, as ``load_state_dict(strict=False)`` would; a tensor of another shape is still refused."""
    target = {"model": model.state_dict()}
    try:
        chain.load_into(target, Path(path), partial=not strict)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        cause = root_cause(e)
        if not any(said in str(cause) for said in ("Size mismatch", "Missing key in checkpoint state_dict")):
            raise
        raise ConfigurationError(
            f"The checkpoint {str(path)!r} does not fit this model ({type(cause).__name__}: {cause}): it was saved "
            "from a model with other tables or parameters. Resume with the model it was saved from, or start afresh "
            "(no ckpt_path, AsyncCheckpoint(resume=False) or another dirpath); for layers added since, "
            "LightningModule.strict_loading = False keeps their new values.") from e
    model.load_state_dict(target["model"], strict=strict)


def load_fused(path: str | os.PathLike, fused: Any) -> None:
    if hasattr(fused, "init_state") and not fused.state_dict().get("state"):
        fused.init_state()  # KeyedOptimizer state is lazy: build it, or DCP has no targets to fill
    target = {"fused": fused.state_dict()}
    try:
        chain.load_into(target, Path(path))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        cause = root_cause(e)
        if "Missing key in checkpoint state_dict: fused." in str(cause):
            raise ConfigurationError(
                f"The checkpoint {str(path)!r} has no such embedding optimizer state ({cause}): it was saved with "
                "another fused optimizer. Resume with the ETTStrategy(fused_optimizer=...) it was saved with.") from e
        if "Size mismatch" not in str(cause):
            raise
        raise ConfigurationError(
            f"The checkpoint {str(path)!r} holds the embedding optimizer's state in another shape than this layout "
            f"needs ({cause}). Either the fused optimizer changed (row-wise AdaGrad keeps one value per row, "
            "AdaGrad and Adam one per element: resume with the ETTStrategy(fused_optimizer=...) it was saved with), "
            "or a table's column split did: row-wise optimizer state has one value per row per column shard, so a "
            "table whose split changed (column_wise / table_column_wise / grid vs row- or table-wise, or another "
            "min_partition) cannot take it over. Resume with the same sharding type and min_partition for that "
            "table; 1D, 2D and any sharding_group_size may differ.") from e
    fused.load_state_dict(target["fused"])
