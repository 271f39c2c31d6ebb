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

import bisect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_ett.checkpoint import chain, dcp_io
from lightning_ett.checkpoint.layout import chain_of, commit_checkpoint, read_meta, require_complete
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
    return [names[id(param)] for param in _params(optimizer)]


def name_keyed_optimizer_state(optimizer: Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names instead of positions, so it survives re-wrapping."""
    state = optimizer.state_dict()
    index_to_name = dict(enumerate(_position_names(optimizer, names)))
    return {
        "state": {index_to_name[i]: s for i, s in state["state"].items()},
        "param_groups": [dict(g, params=[index_to_name[i] for i in g["params"]]) for g in state["param_groups"]],
    }


def load_name_keyed_optimizer_state(optimizer: Optimizer, saved: dict[str, Any], names: dict[int, str]
                                    ) -> tuple[list[str], list[str]]:
    """Load :func:`name_keyed_optimizer_state`'s output into ``optimizer``, by parameter name.

    Made for a plan that changed between save and resume: a parameter the optimizer holds that the checkpoint has
    no entry for (a table sharded when saved, data-parallel now) keeps the state the optimizer gave it (none, or what
    its constructor made), and state for a parameter it no longer holds (the reverse: the table's state is now the
    fused optimizer's) is left behind. Returns those two lists of names, (new, left behind with state), for the
    caller to warn about. Groups are matched by position, as torch matches them, and a parameter both know must be
    in the same group in both (else its hyperparameters would silently be another group's); each group's parameters
    are numbered in the optimizer's order, so state lands by name whatever order the checkpoint listed them in.
    """
    positions = _position_names(optimizer, names)
    index = {name: i for i, name in enumerate(positions)}
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ConfigurationError(
            f"The checkpoint's optimizer has {len(saved['param_groups'])} parameter groups and configure_optimizers "
            f"now makes {len(optimizer.param_groups)}: resume with the configure_optimizers it was saved with, or "
            "start afresh.")
    groups, first = [], 0
    for number, (was, now) in enumerate(zip(saved["param_groups"], optimizer.param_groups, strict=True)):
        here = set(positions[first:first + len(now["params"])])
        moved = sorted(n for n in was["params"] if n in index and n not in here)
        if moved:
            raise ConfigurationError(
                f"configure_optimizers puts {moved[:3]} in another parameter group than the checkpoint's group "
                f"{number}: their hyperparameters would be another group's. Resume with the parameter groups it was "
                "saved with, or start afresh.")
        group = dict(was, params=list(range(first, first + len(now["params"]))))
        if "param_names" in now:
            group["param_names"] = now["param_names"]
        else:
            group.pop("param_names", None)
        groups.append(group)
        first += len(now["params"])
    had = {name for group in saved["param_groups"] for name in group["params"]} | set(saved["state"])
    new = [n for n in positions if n not in had]
    made = {p: optimizer.state[p] for p in _params(optimizer) if names[id(p)] not in had and p in optimizer.state}
    optimizer.load_state_dict({"state": {index[n]: s for n, s in saved["state"].items() if n in index},
                               "param_groups": groups})
    optimizer.state.update(made)  # torch keeps only the loaded state: what a constructor made for a new one comes back
    return new, sorted(set(saved["state"]) - set(index))


def _has_prefix(keys: list[str], prefix: str) -> bool:
    """Whether any of the sorted ``keys`` starts with ``prefix`` (a binary search: tables x keys can be large)."""
    at = bisect.bisect_left(keys, prefix)
    return at < len(keys) and keys[at].startswith(prefix)


def _params(optimizer: Optimizer) -> list[Any]:
    return [param for group in optimizer.param_groups for param in group["params"]]


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


def load_fused(path: str | os.PathLike, fused: Any) -> list[str]:
    """Load the fused (embedding) optimizer's state from the checkpoint at ``path``, any layout.

    A table the checkpoint holds no state for at all (data-parallel when it was saved: the dense optimizer's then,
    or added since) keeps its fresh state; returns those tables' parameter names on this rank, for the caller to
    warn about. A table with some of its state missing is another optimizer's: an error, as before.
    """
    if hasattr(fused, "init_state") and not fused.state_dict().get("state"):
        fused.init_state()  # KeyedOptimizer state is lazy: build it, or DCP has no targets to fill
    target = {"fused": fused.state_dict()}
    held = sorted(dcp_io.saved_keys(chain_of(Path(path))[0]))  # a chain's row-tracked state is its full save's
    fresh = [name for name, value in target["fused"].get("state", {}).items()
             if value and not _has_prefix(held, f"fused.state.{name}.")]  # (SGD's tables have empty state)
    loaded = {"fused": {**target["fused"], "state": {name: value for name, value in target["fused"]["state"].items()
                                                     if name not in fresh}}} if fresh else target
    try:
        chain.load_into(loaded, Path(path))  # in place: the same tensors as ``target``'s
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
    fused.load_state_dict({**loaded["fused"], "state": {**target["fused"]["state"], **loaded["fused"]["state"]}})
    return fresh
