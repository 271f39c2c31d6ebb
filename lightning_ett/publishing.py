"""Published models for serving: the artifact format, and the export from a training checkpoint.

A publish directory holds one directory per version and a ``latest`` pointer::

    publish_dir/
      latest                  "v000003": replaced atomically, so a server can poll it
      v000002/ model.pt  manifest.json
      v000003/ model.pt  manifest.json

``model.pt`` is the model's weights, unsharded — embedding tables included, no optimizer
state — as a flat ``{name: tensor}`` dict written by ``torch.save``: it loads with
``torch.load(path, weights_only=True)`` into the plain (unsharded) ``nn.Module`` on any world
size, with torch and torchrec alone. ``manifest.json`` says which checkpoint and step it came
from, when, the metrics the user named, and the size and CRC-32 of ``model.pt``.

A version is written into ``v<N>.tmp`` and renamed only once fsynced with its manifest, so
a directory named ``v<N>`` is always complete. This module imports only torch: it runs in the
publisher's own process (:mod:`lightning_ett.publish_worker`) and in serving code.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_ett import checkpoint_format as fmt
from lightning_ett.fsutil import atomic_write_text, fsync_path

ARTIFACT_FILE = "model.pt"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
LOCK_FILE = ".lock"
FORMAT = "ett-published-v1"
_VERSION = re.compile(r"^v(\d{6,})$")


@dataclass(frozen=True)
class PublishRequest:
    """What the trainer hands the publisher process: a committed checkpoint and the facts to record."""

    source: str  # a committed AsyncCheckpoint directory
    step: int
    metrics: dict[str, float | None] = field(default_factory=dict)
    submodule: str | None = None  # export only this submodule's weights, with names relative to it

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> PublishRequest:
        return cls(**json.loads(line))


def version_name(version: int) -> str:
    return f"v{version:06d}"


def published_versions(root: Path) -> list[tuple[int, Path]]:
    """Complete (renamed) versions under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = ((_VERSION.match(p.name), p) for p in root.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m and p.is_dir())


def read_manifest(version_dir: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((version_dir / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def latest_version_dir(root: str | os.PathLike) -> Path:
    """The version ``latest`` names; raises ``FileNotFoundError`` when nothing was published."""
    root = Path(root)
    try:
        name = (root / LATEST_FILE).read_text().strip()
    except OSError as e:
        raise FileNotFoundError(f"No published model under {str(root)!r}: {LATEST_FILE!r} is missing.") from e
    return root / name


def load_published(path: str | os.PathLike, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Weights and manifest of a published version (a version directory, or a publish directory: its latest).

    Equivalent to ``torch.load(version_dir / "model.pt", weights_only=True)`` plus the
    manifest, with the CRC-32 checked when ``verify``.
    """
    path = Path(path)
    version_dir = path if (path / ARTIFACT_FILE).is_file() else latest_version_dir(path)
    manifest = read_manifest(version_dir)
    if manifest is None:
        raise FileNotFoundError(f"{str(version_dir)!r} has no valid {MANIFEST_FILE}: not a published model.")
    artifact = version_dir / ARTIFACT_FILE
    if verify and fmt.crc32_of(artifact) != manifest["files"][ARTIFACT_FILE]["crc32"]:
        raise OSError(f"{str(artifact)!r} fails its CRC-32 check (corrupted).")
    return torch.load(artifact, map_location="cpu", weights_only=True), manifest


# ---------------------------------------------------------------------- export (publisher process)
def _model_weights(source: Path, submodule: str | None) -> dict[str, torch.Tensor]:
    """The ``model`` entry of a checkpoint, every tensor whole, in this process's memory.

    DCP's metadata knows each tensor's full shape, so sharded tables (ShardedTensors when
    saved) come back unsharded. ``_load_state_dict_from_keys`` is private but is what
    ``dcp_to_torch_save`` uses; the public function would read the optimizer state too.
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        model = _load_state_dict_from_keys(keys={"model"}, checkpoint_id=str(source))["model"]
    if submodule:
        prefix = submodule + "."
        model = {k[len(prefix):]: v for k, v in model.items() if k.startswith(prefix)}
        if not model:
            raise KeyError(f"the checkpoint holds no weights under submodule {submodule!r}")
    return {k: v.detach().contiguous() for k, v in model.items() if isinstance(v, torch.Tensor)}


def newest_published_source(root: Path) -> tuple[str | None, int | None]:
    for _, path in reversed(published_versions(root)):
        manifest = read_manifest(path)
        if manifest is not None:
            return manifest.get("source_checkpoint"), manifest.get("global_step")
    return None, None


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """One writer of ``root`` at a time (an advisory ``flock``): versions are numbered and renamed under it."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK_FILE, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def export(request: PublishRequest, root: Path, keep_last_n: int | None) -> dict[str, Any]:
    """Publish ``request.source`` as the next version under ``root``; returns its manifest.

    A checkpoint already published (the same source and step as the newest version, e.g.
    after a restart) is not published again: the returned manifest has ``"skipped": True``.
    """
    with locked(root):
        return _export(request, root, keep_last_n)


def _export(request: PublishRequest, root: Path, keep_last_n: int | None) -> dict[str, Any]:
    start = time.perf_counter()
    source = Path(request.source)
    if newest_published_source(root) == (str(source), request.step):
        return {"skipped": True, "global_step": request.step, "source_checkpoint": str(source)}
    problem = fmt.verify(source, checksums=False)  # sizes: the writer checksummed it a moment ago
    if problem is not None:
        raise FileNotFoundError(f"checkpoint {str(source)!r} cannot be published: {problem}")
    weights = _model_weights(source, request.submodule)
    checkpoint_manifest = fmt.read_manifest(source) or {}

    versions = published_versions(root)
    version = (versions[-1][0] if versions else 0) + 1
    final = root / version_name(version)
    tmp = root / (final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    artifact = tmp / ARTIFACT_FILE
    torch.save(weights, artifact)
    with open(artifact, "rb") as f:
        os.fsync(f.fileno())
    manifest = {
        "format": FORMAT,
        "version": version,
        "global_step": request.step,
        "time": time.time(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "checkpoint_time": checkpoint_manifest.get("time"),
        "source_checkpoint": str(source),
        "metrics": request.metrics,
        "submodule": request.submodule,
        "tensors": len(weights),
        "parameters": sum(t.numel() for t in weights.values()),
        "torch_version": torch.__version__,
        "files": {ARTIFACT_FILE: {"bytes": artifact.stat().st_size, "crc32": fmt.crc32_of(artifact, drop_cache=True)}},
    }
    atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1))
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(root)
    atomic_write_text(root / LATEST_FILE, final.name + "\n")
    if keep_last_n is not None:
        for _, old in published_versions(root)[:-keep_last_n]:
            doomed = old.with_name(old.name + ".deleting")  # renamed first: a half-deleted v<N> never exists
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    manifest["path"] = str(final)
    manifest["seconds"] = time.perf_counter() - start
    return manifest


def remove_stale(root: Path) -> None:
    """Delete what a killed publisher left: ``v<N>.tmp`` (never complete) and ``v<N>.deleting`` directories."""
    if root.is_dir():
        with locked(root):
            for leftover in [*root.glob("v*.tmp"), *root.glob("v*.deleting")]:
                shutil.rmtree(leftover, ignore_errors=True)
