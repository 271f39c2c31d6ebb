"""Restore from a checkpoint of either kind: a full one, or an incremental one with the chain it builds on.

An incremental checkpoint's sharded tensors are its chain's full save plus every delta after
it, oldest first (a row changed twice takes its newest value); its dense state and
``lightning.pt`` are its own. Both readers here fill the targets they are given the same way:

* :func:`load_into` — sharded targets, any layout (DCP reshards the full save; the deltas'
  global coordinates are pasted into whatever shards this rank holds);
* :func:`read_whole` — one entry with every tensor whole, in this process (the publisher,
  strategies without sharding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_ett.checkpoint import dcp_io, delta
from lightning_ett.checkpoint.layout import chain_of


def load_into(target: dict[str, Any], path: Path) -> None:
    """Fill ``target`` (e.g. ``{"model": model.state_dict()}``) from the checkpoint at ``path``, in place."""
    members = chain_of(Path(path))
    if len(members) == 1:
        dcp_io.load_into(target, members[0])
        return
    sharded, dense = delta.only_sharded(target), delta.without_sharded(target)
    if sharded:
        dcp_io.load_into(sharded, members[0])  # in place: the shards are the target's own tensors
    if dense:
        dcp_io.load_into(dense, members[-1])
        _merge(target, dense)  # non-tensor leaves (param groups) come back as new objects
    for member in members[1:]:
        delta.apply(delta.read(member), target)


def read_whole(path: Path, key: str) -> dict[str, Any]:
    """Entry ``key`` of the checkpoint at ``path`` with every tensor whole (see :func:`dcp_io.read_whole`)."""
    members = chain_of(Path(path))
    whole = dcp_io.read_whole(members[0], key)
    if len(members) == 1:
        return whole
    try:
        whole.update(dcp_io.read_whole(members[-1], key))  # its dense state (the full save's sharded tensors stay)
    except KeyError:
        pass  # nothing dense under ``key`` (a model of tables only)
    for member in members[1:]:
        for record in delta.read(member):
            if record.key[0] == key and (leaf := delta.leaf_at(whole, record.key[1:])) is not None:
                delta.apply_whole(record, leaf)
    return whole


def _merge(target: dict[str, Any], loaded: dict[str, Any]) -> None:
    for key, value in loaded.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value
