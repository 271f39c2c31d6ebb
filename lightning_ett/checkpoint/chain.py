"""Restore from a checkpoint of either kind: a full one, or an incremental one with the chain it builds on.

An incremental checkpoint's row-tracked tensors (those sharded when it was saved, listed in
its manifest as ``tracked``) are its chain's full save plus every delta after it, oldest first
(a row changed twice takes its newest value); everything else and ``lightning.pt`` are its own.
Which is which goes by how a tensor was *saved*, not by how the target holds it, so a table
that a new plan shards differently, or makes data-parallel, is restored the same. Both readers
here fill the targets they are given the same way:

* :func:`load_into` — sharded targets, any layout (DCP reshards the full save; the deltas'
  global coordinates are pasted into whatever shards this rank holds);
* :func:`read_whole` — one entry with every tensor whole, in this process (the publisher,
  strategies without sharding).

How long a chain may grow is :func:`next_delta_budget`: by its estimated restore time. When the next
delta would not fit, :class:`Rebase` says whether a *rebase* (a delta of every row changed since the
chain's full save, built on that full save alone) costs less than a new full save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ett.checkpoint import dcp_io, delta
from lightning_ett.checkpoint.layout import chain_of, tracked_keys


def load_into(target: dict[str, Any], path: Path, partial: bool = False) -> None:
    """Fill ``target`` (e.g. ``{"model": model.state_dict()}``) from the checkpoint at ``path``, in place.

    ``partial``: an entry the checkpoint lacks keeps its value (:func:`dcp_io.load_into`)."""
    members = chain_of(Path(path))
    if len(members) == 1:
        dcp_io.load_into(target, members[0], partial)
        return
    tracked = tracked_keys(members[-1])
    from_full = delta.subset(target, lambda key, _: key in tracked)
    own = delta.subset(target, lambda key, _: key not in tracked)
    if from_full:
        dcp_io.load_into(from_full, members[0], partial)  # in place: the target's own tensors
        _merge(target, from_full)
    if own:
        dcp_io.load_into(own, members[-1], partial)
        _merge(target, own)  # non-tensor leaves (param groups) come back as new objects
    for member in members[1:]:
        delta.apply(delta.read(member, delta.read_index(member), target), target)


def read_whole(path: Path, key: str) -> dict[str, Any]:
    """Entry ``key`` of the checkpoint at ``path`` with every tensor whole (see :func:`dcp_io.read_whole`)."""
    members = chain_of(Path(path))
    whole = dcp_io.read_whole(members[0], key)
    if len(members) == 1:
        return whole
    tracked = tracked_keys(members[-1])
    try:
        own = dcp_io.read_whole(members[-1], key)
    except KeyError:
        own = {}  # nothing but row-tracked tensors under ``key`` (a model of tables only)
    _merge(whole, delta.subset(own, lambda k, _: (key, *k) not in tracked))
    for member in members[1:]:
        for record in delta.read(member):
            if record.key[0] == key and (leaf := delta.leaf_at(whole, record.key[1:])) is not None:
                delta.apply_whole(record, leaf)
    return whole


#: A chain is kept to what restores in this fraction of a full restore's time more: a restore from any of its
#: checkpoints is *estimated* to take at most ~1.4 full restores. #34's bound is 1.5; the estimate (below) was
#: exceeded by up to 0.12 in measured runs (1.61x warm for an estimated 1.49x, 2026-12-06), so 0.1 is kept in hand;
#: not enough everywhere: cold restores of the longest chains reached 1.62x at the final code (below).
MAX_EXTRA_RESTORE = 0.4
#: What a delta costs to restore beyond its bytes, as bytes of a full save read by each rank: its manifest and
#: index read, its file opened and parsed, its rows scattered into the tables. Its rows count at a full save's
#: rate. Calibrated by the benchmark (``incremental_checkpoint.py``, 2026-12-05, 2 CPU ranks, 1 GiB of tables a
#: rank, deltas of ~19 MiB of rows a rank, every checkpoint restored 3x cold and 3x warm): warm, each delta adds
#: 0.0195 s to a 0.78 s full restore (0.025 of it: its bytes and ~5 MiB more); 1.5x is reached at 19-20 deltas when
#: chains are forced longer (``--restore-full-every 21``), and the policy's own chains of 17 deltas (with 10 MiB)
#: restored at 1.50x warm / 1.45x cold (3 jobs, medians): no margin. With 13 MiB the policy's chains were 16 deltas,
#: not the 15 estimated from whole saves (a delta's rows are ~37 of its 41 MiB), and on a slower VM (2026-12-06:
#: full restores 1.08 s warm, 2.27 s cold) restored at 1.47x warm / 1.52x cold. 15 MiB stops them at 15 deltas:
#: 1.45x / 1.40x in that run, 1.39-1.41x warm before, and 1.61x warm / 1.41x cold in the next run: a delta's warm
#: cost relative to a full restore moved by 1.9x between runs on that VM, so the bound is an estimate that a run can
#: exceed; a slower disk or file system may take more too. These runs: ``benchmarks/data/superseded.md``; at the
#: final code the longest chains restored at 1.45-1.62x cold, over the bound (``benchmarks/README.md``, #34).
DELTA_OPEN_BYTES_PER_RANK = 15 << 20


def next_delta_budget(full_bytes: int, chain_bytes: int, deltas: int, world_size: int) -> float:
    """How many bytes of rows the next delta may hold before a restore of the chain would take more than
    ``1 + MAX_EXTRA_RESTORE`` full restores (<= 0: the next save must be full).

    The estimate: a full restore reads ``full_bytes``; each delta adds its bytes and a fixed cost
    (``DELTA_OPEN_BYTES_PER_RANK`` on every rank). Bytes alone would let small deltas pile up: a
    chain of many tiny deltas restores slowly though it is small, and on small tables a full save
    is cheap anyway.
    """
    if full_bytes <= 0:
        return -math.inf
    open_cost = DELTA_OPEN_BYTES_PER_RANK * max(world_size, 1)
    return MAX_EXTRA_RESTORE * full_bytes - chain_bytes - (deltas + 1) * open_cost


@dataclass(frozen=True)
class Rebase:
    """Whether a *rebase* pays when the chain's next delta would not fit its restore bound.

    A rebase holds every row changed since the chain's full save (one-shot differential, Check-N-Run's
    other scheme), and the chain goes on from it: a restore reads the full save, the rebase and the
    deltas after it, so the deltas before it are no longer read (retention may drop them). On a
    heavy-tailed stream the rows changed since the full save grow far slower than the deltas' sum (hot
    rows change in every interval: Zipf 1.05, 1.7 % of the rows per 50 steps, 14 intervals: 24 % in
    the deltas, 13 % in their union), so a rebase is much smaller than a full save and leaves room for
    more deltas. It pays while its bytes, spread over the saves until the chain must be cut again,
    cost less per save than a full save spread the same way (both with deltas as big as the last).
    """

    full_bytes: int  # the chain's full save
    world_size: int

    def pays(self, since_full_bytes: float, delta_bytes: float) -> bool:
        """A rebase of ``since_full_bytes`` of rows (all ranks) instead of a full save, deltas of ``delta_bytes``?"""
        if next_delta_budget(self.full_bytes, 0, 0, self.world_size) < since_full_bytes:
            return False  # the rebase alone would outgrow the bound
        after_rebase = self._deltas_after(since_full_bytes, 1, delta_bytes)
        after_full = self._deltas_after(0, 0, delta_bytes)
        per_save_rebase = (since_full_bytes + after_rebase * delta_bytes) / (after_rebase + 1)
        per_save_full = (self.full_bytes + after_full * delta_bytes) / (after_full + 1)
        return per_save_rebase < per_save_full

    def _deltas_after(self, chain_bytes: float, deltas: int, delta_bytes: float) -> int:
        """How many deltas of ``delta_bytes`` fit after a chain of ``chain_bytes`` in ``deltas`` deltas."""
        step = max(delta_bytes, 1.0)
        n = 0
        while n < 10_000 and next_delta_budget(self.full_bytes, chain_bytes + n * step, deltas + n,
                                               self.world_size) >= step:
            n += 1
        return n


def _merge(target: dict[str, Any], loaded: dict[str, Any]) -> None:
    for key, value in loaded.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value
