"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory:

* DCP files for the model (sharded tables as ShardedTensors, dense tensors deduplicated)
  and the fused embedding optimizer's state; DCP reshards them on load, so a checkpoint
  written by N ranks loads on M.
* ``lightning.pt`` (rank 0): everything else Lightning puts in a checkpoint — loops,
  callbacks, schedulers — and the dense optimizers' state keyed by parameter name (dense
  parameters are replicated, so one copy serves any world size).

All ranks write into ``<dir>.tmp``; after a barrier rank 0 renames it to ``<dir>``, so a
crash never leaves a directory that looks complete under the checkpoint's name. A directory
without ``lightning.pt`` and DCP's ``.metadata`` is refused on load.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

from lightning_ett.checkpoint_format import META_FILE, remove

MODEL_KEY = "state_dict"
DENSE_KEY = "optimizer_states"


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


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / META_FILE).is_file() and (Path(path) / ".metadata").is_file()


def save_sharded(
    tensors: dict[str, Any], checkpoint: dict[str, Any], path: str | os.PathLike, rank: int, barrier: Callable[[], None]
) -> None:
    """Write ``tensors`` with DCP and ``checkpoint`` (the rest) as ``lightning.pt`` (collective: every rank calls it)."""
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    dcp.save(tensors, checkpoint_id=str(tmp))
    if rank == 0:
        meta = dict(checkpoint)
        meta_tmp = tmp / (META_FILE + ".part")
        torch.save(meta, meta_tmp)
        with open(meta_tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(meta_tmp, tmp / META_FILE)
    barrier()
    if rank == 0:
        # Overwriting a name (e.g. last.ckpt): the old copy is moved aside, not deleted, until the
        # new one is in place; a crash in between leaves it as `<name>.old`, which load_meta takes.
        old = _old(final)
        remove(old)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        remove(old)
    barrier()


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not is_complete(path) and is_complete(_old(path)):
        warnings.warn(f"{str(path)!r} is missing or incomplete (a crash while it was replaced); "
                      f"loading the previous copy {str(_old(path))!r}.", stacklevel=2)
        path = _old(path)
    if not is_complete(path):
        raise FileNotFoundError(
            f"{str(path)!r} is not a complete ETTStrategy checkpoint (no {META_FILE} or DCP .metadata in it)."
        )
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    meta["ett_checkpoint_dir"] = str(path)
    return meta


def load_model(path: str | os.PathLike, model: nn.Module, strict: bool = True) -> None:
    target = {"model": model.state_dict()}
    dcp.load(target, checkpoint_id=str(path))
    model.load_state_dict(target["model"], strict=strict)


def load_fused(path: str | os.PathLike, fused: Any) -> None:
    if hasattr(fused, "init_state") and not fused.state_dict().get("state"):
        fused.init_state()  # KeyedOptimizer state is lazy: build it, or DCP has no targets to fill
    target = {"fused": fused.state_dict()}
    dcp.load(target, checkpoint_id=str(path))
    fused.load_state_dict(target["fused"])
