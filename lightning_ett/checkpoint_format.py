"""The on-disk checkpoint format shared by ETTStrategy and AsyncCheckpoint.

A checkpoint is a directory:

* DCP files (``.metadata``, ``__<rank>_<i>.distcp``) for the tensors that dominate its size:
  ``{"model": ...}`` and, under ETTStrategy, ``{"fused": ...}`` (the fused embedding
  optimizer). Sharded tables are ShardedTensors, so DCP reshards them on load.
* ``lightning.pt``: everything else Lightning puts in a checkpoint (loops, callbacks,
  optimizer states, schedulers). ``torch.save`` keeps the optimizers' integer keys that DCP
  would turn into strings.
* ``manifest.json``, written last by AsyncCheckpoint: global step, time, and the size and
  CRC-32 of every other file. A directory is *complete* only with a manifest that matches
  its files. CRC-32 (2 GB/s here, ~2x sha256) is for detecting truncation and bit rot, not
  tampering.

AsyncCheckpoint writes into ``<name>.tmp`` and renames it only once every file is fsynced and
the manifest is in place; ``latest`` names the newest complete checkpoint and is replaced
atomically after the rename.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_ett.fsutil import atomic_write_text

META_FILE = "lightning.pt"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
TMP_SUFFIX = ".tmp"
REPLACED_SUFFIX = ".replaced"
#: In a committed checkpoint: ModelPublisher is reading it, retention keeps it (not part of the manifest).
PIN_FILE = ".publisher-pin"
FORMAT = "ett-dcp-v1"
_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def crc32_of(path: Path, drop_cache: bool = False) -> int:
    """CRC-32 of a file, in one C call over a memory map where the filesystem allows it.

    One call releases the GIL once for the whole file instead of handing it back and forth
    with the training thread per chunk. ``drop_cache``: the checksum is the last read of a
    freshly written (fsynced, clean) checkpoint, so its pages leave the page cache: cached
    checkpoint pages slowed every later write here and would evict the training data's.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        crc = 0
        if size:
            try:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                    crc = zlib.crc32(view)
            except (OSError, ValueError):  # e.g. a FUSE filesystem without mmap
                while block := f.read(64 << 20):
                    crc = zlib.crc32(block, crc)
        if drop_cache and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass  # only an optimization
        return crc


def write_manifest(directory: Path, step: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Checksum every file in ``directory`` (already fsynced) and write the manifest, durably."""
    files = {}
    for f in sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST_FILE):
        files[f.name] = {"bytes": f.stat().st_size, "crc32": crc32_of(f, drop_cache=True)}
    manifest = {"format": FORMAT, "global_step": step, "files": files, **(extra or {})}
    atomic_write_text(directory / MANIFEST_FILE, json.dumps(manifest, indent=1))
    return manifest


def read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    valid = isinstance(manifest, dict) and manifest.get("format") == FORMAT and isinstance(manifest.get("files"), dict)
    return manifest if valid else None


def verify(directory: Path, checksums: bool = True) -> str | None:
    """``None`` if ``directory`` is a complete checkpoint, else what is wrong with it."""
    manifest = read_manifest(directory)
    if manifest is None:
        return f"no valid {MANIFEST_FILE} (never completed)"
    try:
        for name, expected in manifest["files"].items():
            path = directory / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != expected["bytes"]:
                return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']} (truncated?)"
            if checksums and crc32_of(path) != expected["crc32"]:
                return f"{name} fails its CRC-32 check (corrupted)"
    except (OSError, KeyError, TypeError) as e:
        return f"cannot be checked ({e!r})"
    return None


@dataclass(frozen=True)
class CheckpointEntry:
    path: Path
    step: int
    seq: int  # commit number: later commits are newer, whatever their step


def committed(root: Path) -> list[CheckpointEntry]:
    """Renamed (committed) checkpoint directories under ``root``, oldest commit first, unverified."""
    if not root.is_dir():
        return []
    entries = []
    for d in root.iterdir():
        m = _NAME.match(d.name)
        if m and d.is_dir() and (d / MANIFEST_FILE).is_file():
            manifest = read_manifest(d) or {}
            seq = manifest.get("seq")
            entries.append(CheckpointEntry(d, int(m.group(1)), seq if isinstance(seq, int) else 0))
    return sorted(entries, key=lambda e: (e.seq, e.step))


def newest_complete(root: Path, checksums: bool = True) -> Path | None:
    """The newest checkpoint under ``root`` that passes :func:`verify`; warns about each one skipped."""
    for entry in reversed(committed(root)):
        problem = verify(entry.path, checksums)
        if problem is None:
            return entry.path
        warnings.warn(f"Skipping checkpoint {str(entry.path)!r}: {problem}. Trying an older one.", stacklevel=2)
    return None


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / META_FILE).is_file() and (p / ".metadata").is_file()


def remove(path: Path) -> None:
    """Delete a checkpoint, directory or file, if it exists."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def load_unsharded(path: str | os.PathLike) -> dict[str, Any]:
    """A whole Lightning checkpoint dict from a directory written without a sharded model.

    The model's tensors are read in full (no target state dict needed), so any strategy
    that keeps a full copy of the model (single device, DDP) can load it.
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
    path = Path(path)
    checkpoint = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    tensors = _load_state_dict_from_keys(keys={"model"}, checkpoint_id=str(path))
    checkpoint["state_dict"] = tensors["model"]
    return checkpoint
