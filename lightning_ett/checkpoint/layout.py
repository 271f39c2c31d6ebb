"""The on-disk checkpoint format shared by ETTStrategy's save and AsyncCheckpoint, and how one is chosen.

A checkpoint is a directory:

* DCP files (``.metadata``, ``__<rank>_<i>.distcp``) for the tensors that dominate its size:
  ``{"model": ...}`` and, under ETTStrategy, ``{"fused": ...}`` (the fused embedding
  optimizer). Sharded tables are ShardedTensors, so DCP reshards them on load.
* ``lightning.pt``: everything else Lightning puts in a checkpoint (loops, callbacks,
  optimizer states, schedulers). ``torch.save`` keeps the optimizers' integer keys that DCP
  would turn into strings.
* ``manifest.json``, written last by the one commit protocol
  (:mod:`lightning_ett.durable.commit`): global step, time, commit sequence, and the size and
  CRC-32 of every other file. A directory is *complete* only with a manifest that matches
  its files; nothing else is ever loaded.

AsyncCheckpoint names its checkpoints ``step-<global step>`` and keeps ``latest`` pointing at
the newest; ``trainer.save_checkpoint`` keeps the name it is given.

An *incremental* checkpoint (``AsyncCheckpoint(incremental=True)``) holds the dense state in
full and, in ``delta-rank<r>.pt``, only the rows of the sharded tensors that changed since the
previous checkpoint (:mod:`lightning_ett.checkpoint.delta`), and in ``delta-index.json`` where each
rank's file's rows lie (a restore opens only the files it needs). Its manifest names its *chain*:
the full checkpoint it builds on and every delta between, each with its commit number; a *rebase*
(every row changed since the full save) builds on the full save alone, so the chain of a delta
after it is the full save, the rebase and the deltas between. It is
complete only if every member of its chain is still there, unchanged (same commit number) and
complete itself: a corrupt or missing delta makes every later one of its chain incomplete, so
resuming falls back to the newest valid prefix, and retention never deletes a member of a kept
checkpoint's chain.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_ett.durable import manifest
from lightning_ett.durable.commit import commit_directory, replaced_path
from lightning_ett.durable.errors import IncompleteCheckpointError
from lightning_ett.durable.manifest import MANIFEST_FILE, read_manifest

META_FILE = "lightning.pt"
LATEST_FILE = "latest"
#: In a committed checkpoint: ModelPublisher is reading it, retention keeps it (not part of the manifest).
PIN_FILE = ".publisher-pin"
FORMAT = "ett-dcp-v1"
STEP_PATTERN = "step-*"
_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def step_of(path: str | os.PathLike) -> int | None:
    """The step a committed checkpoint's name says (``None`` for another name)."""
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def verify(directory: Path, checksums: bool = True, seen: dict[tuple[str, Any], str | None] | None = None) -> str | None:
    """``None`` if ``directory`` is a complete checkpoint (with its whole chain), else what is wrong, naming the file.

    ``seen``: verdicts of directories verified before, by (name, commit), so that choosing among
    many deltas of one chain reads each member once (:func:`newest_complete`).
    """
    seen = {} if seen is None else seen

    def own(path: Path) -> str | None:
        key = (path.name, (read_manifest(path, FORMAT) or {}).get("seq"))
        if key not in seen:
            seen[key] = manifest.verify(path, FORMAT, checksums)
        return seen[key]

    if (problem := own(directory)) is not None:
        return problem
    for link in chain_links(read_manifest(directory, FORMAT) or {}):
        member = directory.parent / link["name"]
        seq = (read_manifest(member, FORMAT) or {}).get("seq")
        if seq != link["seq"]:
            found = "is missing" if not member.is_dir() else f"was replaced (commit {seq}, the chain needs {link['seq']})"
            return f"the checkpoint it builds on, {link['name']}, {found}"
        if (problem := own(member)) is not None:
            return f"the checkpoint it builds on, {link['name']}, is damaged: {problem}"
    return None


def chain_links(fields: dict[str, Any]) -> list[dict[str, Any]]:
    """An incremental checkpoint's manifest's chain: ``[{"name", "seq"}, ...]``, its full save first ([] for a full one)."""
    links = fields.get("chain") or []
    return [link for link in links if isinstance(link, dict) and "name" in link and "seq" in link]


def tracked_keys(path: Path) -> set[tuple[str, ...]]:
    """An incremental checkpoint's row-tracked tensors (key paths in the checkpoint state); empty for a full one."""
    return {tuple(key) for key in (read_manifest(path, FORMAT) or {}).get("tracked") or []}


def chain_of(path: Path) -> list[Path]:
    """The directories to restore ``path`` from, its full save first and ``path`` last (``[path]`` for a full one)."""
    return [path.parent / link["name"] for link in chain_links(read_manifest(path, FORMAT) or {})] + [path]


@dataclass(frozen=True)
class CheckpointEntry:
    path: Path
    step: int
    seq: int  # commit number: later commits are newer, whatever their step
    chain: tuple[str, ...] = ()  # an incremental checkpoint's: the names it needs to be restored
    rebase: bool = False  # a rebase: every row changed since its chain's full save
    chain_seqs: tuple[int, ...] = ()  # the commit number of each member of ``chain``
    began: tuple[str, ...] | None = None  # the job (id and run dir) and the ckpt_path of the fit that committed it
    process: str | None = None  # the process that committed it, where recorded with ``began``


def committed(root: Path) -> list[CheckpointEntry]:
    """Renamed (committed) checkpoint directories under ``root``, oldest commit first, unverified."""
    if not root.is_dir():
        return []
    entries = []
    for d in root.iterdir():
        step = step_of(d)
        if step is not None and d.is_dir() and (d / MANIFEST_FILE).is_file():
            fields = read_manifest(d, FORMAT) or {}
            seq, links = fields.get("seq"), chain_links(fields)
            began = fields.get("began")
            valid = isinstance(began, list) and len(began) == 2 and all(isinstance(b, str) for b in began)
            entries.append(CheckpointEntry(d, step, seq if isinstance(seq, int) else 0,
                                           tuple(link["name"] for link in links), bool(fields.get("rebase")),
                                           tuple(link["seq"] for link in links), tuple(began) if valid else None,
                                           fields["process"] if isinstance(fields.get("process"), str) else None))
    return sorted(entries, key=lambda e: (e.seq, e.step))


def next_seq(entries: list[CheckpointEntry]) -> int:
    return max((e.seq for e in entries), default=0) + 1


def newest_complete(root: Path, checksums: bool = True, began: tuple[str, ...] | None = None,
                    not_by: str | None = None) -> Path | None:
    """The newest checkpoint under ``root`` that passes :func:`verify` (with ``began``: of those whose manifest says
    they were committed by that job in a fit begun from that ``ckpt_path``; with ``not_by``: by another process than
    that); warns about each one skipped."""
    seen: dict[tuple[str, Any], str | None] = {}
    for entry in reversed(committed(root)):
        if (began is not None and entry.began != began) or (not_by is not None and entry.process == not_by):
            continue
        problem = verify(entry.path, checksums, seen)
        if problem is None:
            return entry.path
        warnings.warn(f"Skipping checkpoint {str(entry.path)!r}: {problem}. Trying an older one.", stacklevel=2)
    return None


def to_delete(entries: list[CheckpointEntry], keep_last_n: int | None) -> list[CheckpointEntry]:
    """Retention: the checkpoints beyond the ``keep_last_n`` newest commits, except pinned ones and chain members.

    ``entries`` are oldest commit first and end with the newest, which is never returned. A
    checkpoint ModelPublisher has pinned (:data:`PIN_FILE`) stays until it is unpinned, and so
    does every checkpoint a kept one is built on (its full save and the deltas between).

    With ``keep_last_n >= 2`` the kept checkpoints rest on at least two full saves, as that many full
    saves would, and on two *bases* (full saves or rebases): when the newest ones all rest on one full
    save, the newest checkpoint resting on another stays too (with its chain), and likewise for one
    base, so one damaged full save or rebase never leaves nothing, and a damaged rebase sends a resume
    back one save. Only a checkpoint whose chain is still there (every member with the commit number it
    names: not one of a line a roll-back replaced) is kept for that.
    """
    if keep_last_n is None:
        return []
    rebases = {e.path.name for e in entries if e.rebase}
    kept = entries[-keep_last_n:] + [e for e in entries[:-keep_last_n] if (e.path / PIN_FILE).exists()]
    if keep_last_n >= 2:
        seqs = {e.path.name: e.seq for e in entries}
        older = [e for e in reversed(entries[:-keep_last_n])
                 if all(seqs.get(name) == seq for name, seq in zip(e.chain, e.chain_seqs, strict=True))]
        for base_of in (_full_save, lambda e: _base(e, rebases)):
            base = base_of(entries[-1])
            if all(base_of(e) == base for e in entries[-keep_last_n:]):
                kept += [e for e in older if base_of(e) != base][:1]
    needed = {e.path.name for e in kept} | {name for e in kept for name in e.chain}
    return [e for e in entries[:-keep_last_n] if e.path.name not in needed]


def _full_save(entry: CheckpointEntry) -> str:
    """The full save a checkpoint is restored from: its chain's first, or itself."""
    return entry.chain[0] if entry.chain else entry.path.name


def _base(entry: CheckpointEntry, rebases: set[str]) -> str:
    """The nearest checkpoint whose damage would make ``entry`` unusable: the newest rebase of its chain (or
    itself, a rebase), else its full save (or itself, a full one)."""
    if entry.rebase or not entry.chain:
        return entry.path.name
    return next((name for name in reversed(entry.chain) if name in rebases), entry.chain[0])


def looks_like_checkpoint(path: str | os.PathLike) -> bool:
    """A directory in this format (complete or not): DCP metadata, or a manifest of ours."""
    p = Path(path)
    return p.is_dir() and ((p / ".metadata").is_file() or (p / MANIFEST_FILE).is_file() or (p / META_FILE).is_file())


def require_complete(path: str | os.PathLike) -> Path:
    """``path`` if it is a complete checkpoint, else raise naming the file (sizes are checked, not checksums).

    Read-only (every rank calls it): if a crash interrupted the replacement of ``path``, the
    complete copy moved aside (``<path>.replaced``) is returned, with a warning.
    """
    path = Path(path)
    problem = verify(path, checksums=False)
    if problem is None:
        return path
    aside = replaced_path(path)
    if not path.exists() and aside.is_dir() and verify(aside, checksums=False) is None:
        warnings.warn(f"{str(path)!r} is missing (a crash interrupted its replacement); loading the previous copy "
                      f"{str(aside)!r}.", stacklevel=2)
        return aside
    raise IncompleteCheckpointError(not_a_checkpoint(path))


def not_a_checkpoint(path: str | os.PathLike) -> str:
    """Why ``path`` is no complete checkpoint to load, naming the file, and what to pass instead."""
    path = Path(path)
    if not path.exists():
        return f"{str(path)!r} does not exist: the ckpt_path names no checkpoint."
    problem = verify(path, checksums=False) or "not one this format writes"
    hint = ""
    entries = committed(path) if path.is_dir() else []
    if entries:  # the checkpoint directory itself, not one of its checkpoints (unverified here: no warnings)
        hint = (f" It is a directory of checkpoints: pass one of them, e.g. the newest, {str(entries[-1].path)!r} (or no "
                "ckpt_path: AsyncCheckpoint resumes from the newest complete one in its dirpath).")
    elif (path / META_FILE).is_file() and not (path / MANIFEST_FILE).exists():
        hint = (" A directory with lightning.pt but no manifest is either unfinished or was written by "
                "lightning-ett 0.1's trainer.save_checkpoint, which wrote none: if you know it is complete, "
                f"`python -m lightning_ett.checkpoint.adopt {str(path)!r}` checksums it and writes one.")
    return f"{str(path)!r} is not a complete checkpoint: {problem}.{hint}"


def read_meta(path: Path) -> dict[str, Any]:
    """``lightning.pt`` of a complete checkpoint (everything but the DCP tensors)."""
    return torch.load(path / META_FILE, map_location="cpu", weights_only=False)


def commit_checkpoint(tmp: Path, final: Path, meta: dict[str, Any], step: int,
                      known: dict[str, tuple[int, int]] | None = None,
                      extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank 0, once every rank's DCP files are in ``tmp``: write ``lightning.pt``, number the commit, commit.

    The commit number orders checkpoints by when they were made, not by step: after a
    roll-back (fit from an older checkpoint) the new line of checkpoints is the newest. Both
    save paths (``trainer.save_checkpoint`` under ETTStrategy, AsyncCheckpoint's writer) end here.
    ``extra``: more manifest fields (an incremental checkpoint's ``kind``, ``chain``, ``tracked``).
    """
    torch.save(meta, tmp / META_FILE)
    seq = next_seq(committed(final.parent))
    fields: dict[str, Any] = {"global_step": step, "time": time.time(), "seq": seq, **(extra or {})}
    return commit_directory(tmp, final, FORMAT, fields, known=known)


def load_unsharded(path: str | os.PathLike) -> dict[str, Any]:
    """A whole Lightning checkpoint dict from a directory written without a sharded model.

    The model's tensors are read in full (no target state dict needed), so any strategy
    that keeps a full copy of the model (single device, DDP) can load it.
    """
    from lightning_ett.checkpoint.chain import read_whole

    path = require_complete(path)
    checkpoint = read_meta(path)
    checkpoint["state_dict"] = read_whole(path, "model")
    return checkpoint
