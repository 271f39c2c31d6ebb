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

With ``ModelPublisher(deltas=True)`` a version between full ones holds ``delta.pt`` instead:
the rows of each table that changed since the version before it (byte-wise, as the publisher
process holds that version's weights), and every other tensor whole. Its manifest says
``"kind": "delta"``, the ``base_version`` it applies to, and its ``chain`` (the full version and
the deltas before it). A server holding version ``N`` applies the delta whose ``base_version``
is ``N`` with :func:`apply_published_delta`; :func:`load_published` rebuilds any version from
its chain. A new full version is written once a chain's deltas add up to half a full version
(or every ``full_every_n_versions``), and retention keeps every version a kept one builds on.

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
DELTA_FILE = "delta.pt"
_DELTA_FORMAT = 1
#: A new full version once the deltas reach half a full one, by bytes alone (AsyncCheckpoint also counts a fixed
#: cost per delta, ``chain.next_delta_budget``): a server applies each delta as it comes, once; only a server
#: starting cold reads a chain whole, and bytes bound that read to 1.5 full versions.
_MAX_CHAIN_FRACTION = 0.5
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
    deltas: bool = False  # publish only the changed rows when the publisher holds the newest version
    full_every_n_versions: int | None = None  # deltas: every N-th version full (None: by the chain's size)

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


def _verified_manifest(version_dir: Path, verify: bool) -> dict[str, Any]:
    problem = verify_directory(version_dir, FORMAT, checksums=verify)
    if problem is not None:
        raise FileNotFoundError(f"{str(version_dir)!r} is not a complete published model: {problem}.")
    manifest = read_manifest(version_dir)
    assert manifest is not None
    return manifest


def load_published(path: str | os.PathLike, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Weights and manifest of a published version (a version directory, or a publish directory: its latest).

    A full version: ``torch.load(version_dir / "model.pt", weights_only=True)`` plus the
    manifest, with the CRC-32 checked when ``verify``. A delta: its chain's full version with
    every delta of the chain applied in order.
    """
    path = Path(path)
    is_version = (path / MANIFEST_FILE).is_file() and _VERSION.match(path.name) is not None
    version_dir = path if is_version or (path / ARTIFACT_FILE).is_file() else latest_version_dir(path)
    manifest = _verified_manifest(version_dir, verify)
    if manifest.get("kind") != "delta":
        return torch.load(version_dir / ARTIFACT_FILE, map_location="cpu", weights_only=True), manifest
    chain = [version_dir.parent / version_name(v) for v in manifest["chain"]]
    weights, held = load_published(chain[0], verify)
    for member in [*chain[1:], version_dir]:
        apply_published_delta(weights, member, held["version"], verify)
        held = read_manifest(member) or {}
    return weights, manifest


def apply_published_delta(weights: dict[str, torch.Tensor], version_dir: str | os.PathLike, held_version: int,
                          verify: bool = True) -> dict[str, Any]:
    """Bring ``weights`` (a server's copy of version ``held_version``) to the delta version at ``version_dir``, in place.

    Returns that version's manifest. Raises ``ValueError`` if the delta applies to another
    version than the one held (reload with :func:`load_published` then).
    """
    version_dir = Path(version_dir)
    manifest = _verified_manifest(version_dir, verify)
    if manifest.get("kind") != "delta":
        raise ValueError(f"{str(version_dir)!r} is a full version, not a delta: load it with load_published().")
    if manifest["base_version"] != held_version:
        raise ValueError(f"{str(version_dir)!r} applies to version {manifest['base_version']}, not to the version "
                         f"{held_version} held: load it whole with load_published({str(version_dir)!r}).")
    delta = torch.load(version_dir / DELTA_FILE, map_location="cpu", weights_only=True)
    for name in delta["removed"]:
        weights.pop(name, None)
    with torch.no_grad():
        for name, value in delta["replace"].items():  # into the held tensors (a served model's own parameters)
            held = weights.get(name)
            if held is not None and held.shape == value.shape and held.dtype == value.dtype:
                held.copy_(value)
            else:
                weights[name] = value  # new, or reshaped: a dict entry the server must take up itself
        for name, changed in delta["rows"].items():
            table = weights[name]
            table[changed["rows"].to(table.device)] = changed["values"].to(table.device)
    return manifest

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


@dataclass
class HeldVersion:
    """The publisher process's copy of the newest version it published (``deltas=True``): what the next delta is of."""

    version: int
    weights: dict[str, torch.Tensor]
    chain: list[int]  # the full version and the deltas up to and including ``version``
    full_bytes: int
    chain_bytes: int  # the deltas' bytes since the full version


def export(request: PublishRequest, root: Path, keep_last_n: int | None,
           held: HeldVersion | None = None) -> tuple[dict[str, Any], HeldVersion | None]:
    """Publish ``request.source`` as the next version under ``root``; returns its manifest and what to hold next.

    A checkpoint already published (the same source and step as the newest version, e.g.
    after a restart) is not published again: the returned manifest has ``"skipped": True``.
    With ``request.deltas``, the version is a delta of ``held`` when ``held`` is still the
    newest version and the chain is short enough.
    """
    with locked(root):
        return _export(request, root, keep_last_n, held)


def _delta_of(held: HeldVersion, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What turns ``held.weights`` into ``weights``: changed rows of tensors of the same shape, others whole."""
    from lightning_ett.checkpoint.delta import changed_rows

    replace: dict[str, torch.Tensor] = {}
    rows: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights.items():
        before = held.weights.get(name)
        if before is None or before.shape != tensor.shape or before.dtype != tensor.dtype or tensor.dim() == 0:
            replace[name] = tensor
            continue
        changed = changed_rows(tensor, before)
        if 2 * changed.numel() >= tensor.shape[0]:
            replace[name] = tensor  # most rows changed (a dense layer): whole is smaller than rows + their numbers
        elif changed.numel():
            rows[name] = {"rows": changed, "values": tensor[changed]}
    removed = sorted(set(held.weights) - set(weights))
    return {"format": _DELTA_FORMAT, "base_version": held.version, "replace": replace, "rows": rows, "removed": removed}


def _export(request: PublishRequest, root: Path, keep_last_n: int | None,
            held: HeldVersion | None) -> tuple[dict[str, Any], HeldVersion | None]:
    start = time.perf_counter()
    source = Path(request.source)
    if newest_published_source(root) == (str(source), request.step):
        return {"skipped": True, "global_step": request.step, "source_checkpoint": str(source)}, held
    problem = layout.verify(source, checksums=False)  # sizes (chain included): the writer checksummed it a moment ago
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
    as_delta = request.deltas and held is not None and bool(versions) and versions[-1][0] == held.version and (
        len(held.chain) < request.full_every_n_versions if request.full_every_n_versions is not None
        else held.chain_bytes < _MAX_CHAIN_FRACTION * held.full_bytes)
    delta_fields: dict[str, Any] = {}
    if as_delta:
        assert held is not None
        torch.save(_delta_of(held, weights), tmp / DELTA_FILE)
        delta_fields = {"kind": "delta", "base_version": held.version, "chain": list(held.chain)}
    else:
        torch.save(weights, tmp / ARTIFACT_FILE)
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
        **delta_fields,
    }
    manifest = commit_directory(tmp, final, FORMAT, fields)
    atomic_write_text(root / LATEST_FILE, final.name + "\n")
    _apply_retention(root, keep_last_n)
    nbytes = sum(f["bytes"] for f in manifest["files"].values())
    if not request.deltas:
        held = None
    elif as_delta:
        assert held is not None
        held = HeldVersion(version, weights, [*held.chain, version], held.full_bytes, held.chain_bytes + nbytes)
    else:
        held = HeldVersion(version, weights, [version], nbytes, 0)
    manifest["path"] = str(final)
    manifest["seconds"] = time.perf_counter() - start
    return manifest, held


def _apply_retention(root: Path, keep_last_n: int | None) -> None:
    """The ``keep_last_n`` newest versions, and every version one of them builds on (its chain)."""
    if keep_last_n is None:
        return
    versions = published_versions(root)
    needed = {number for number, _ in versions[-keep_last_n:]}
    for _, path in versions[-keep_last_n:]:
        needed.update((read_manifest(path) or {}).get("chain", []))
    for number, path in versions[:-keep_last_n]:
        if number not in needed:
            retire(path)


def remove_stale(root: Path) -> None:
    """Settle what a killed publisher left (``v<N>.tmp``, ``.deleting``, ``.replaced`` directories)."""
    if root.is_dir():
        with locked(root):
            commit.remove_stale(root, "v*", FORMAT)


__all__ = ["ARTIFACT_FILE", "DELTA_FILE", "FORMAT", "LATEST_FILE", "MANIFEST_FILE", "PublishRequest", "apply_published_delta",
           "export", "latest_version_dir", "load_published", "published_versions", "read_manifest", "remove_stale",
           "version_name"]
