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

A version is written into ``v<N>.tmp`` and committed by the same protocol as checkpoints
(:mod:`lightning_ett.durable.commit`), so a directory named ``v<N>`` is always complete.
Version numbers only increase within a job, even if the directory is emptied meanwhile: the
trainer passes the last version it published (:attr:`PublishRequest.after_version`). This module
imports only torch: it runs in the publisher's own process (:mod:`lightning_ett.publish.worker`)
and in serving code.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_ett.checkpoint import layout
from lightning_ett.checkpoint.chain import read_whole
from lightning_ett.durable import commit
from lightning_ett.durable.commit import commit_directory, retire, temp_path
from lightning_ett.durable.files import atomic_write_text, remove_path
from lightning_ett.durable.manifest import MANIFEST_FILE
from lightning_ett.durable.manifest import read_manifest as read_any_manifest
from lightning_ett.durable.manifest import verify as verify_directory

ARTIFACT_FILE = "model.pt"
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
    after_version: int = 0  # the last version this job published: the new one is numbered above it

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
    return read_any_manifest(version_dir, FORMAT)


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
    problem = verify_directory(version_dir, FORMAT, checksums=verify)
    if problem is not None:
        raise FileNotFoundError(f"{str(version_dir)!r} is not a complete published model: {problem}.")
    manifest = read_manifest(version_dir)
    assert manifest is not None
    return torch.load(version_dir / ARTIFACT_FILE, map_location="cpu", weights_only=True), manifest


# ---------------------------------------------------------------------- export (publisher process)
def _model_weights(source: Path, submodule: str | None) -> dict[str, torch.Tensor]:
    """The ``model`` entry of a checkpoint, every tensor whole (sharded tables gathered), in this process's memory."""
    model = read_whole(source, "model")
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
    problem = verify_directory(source, layout.FORMAT, checksums=False)  # sizes: the writer checksummed it a moment ago
    if problem is not None:
        raise FileNotFoundError(f"checkpoint {str(source)!r} cannot be published: {problem}")
    weights = _model_weights(source, request.submodule)
    checkpoint_manifest = read_any_manifest(source, layout.FORMAT) or {}

    versions = published_versions(root)
    version = max(versions[-1][0] if versions else 0, request.after_version) + 1
    final = root / version_name(version)
    tmp = temp_path(final)
    remove_path(tmp)
    tmp.mkdir()
    artifact = tmp / ARTIFACT_FILE
    torch.save(weights, artifact)
    fields = {
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
    }
    manifest = commit_directory(tmp, final, FORMAT, fields)
    atomic_write_text(root / LATEST_FILE, final.name + "\n")
    if keep_last_n is not None:
        for _, old in published_versions(root)[:-keep_last_n]:
            retire(old)
    manifest["path"] = str(final)
    manifest["seconds"] = time.perf_counter() - start
    return manifest


def remove_stale(root: Path) -> None:
    """Settle what a killed publisher left (``v<N>.tmp``, ``.deleting``, ``.replaced`` directories)."""
    if root.is_dir():
        with locked(root):
            commit.remove_stale(root, "v*", FORMAT)


__all__ = ["ARTIFACT_FILE", "FORMAT", "LATEST_FILE", "MANIFEST_FILE", "PublishRequest", "export", "latest_version_dir",
           "load_published", "published_versions", "read_manifest", "remove_stale", "version_name"]
