"""The one commit protocol for directories: checkpoints (both save paths) and published models.

A directory is written under ``<name>.tmp`` and becomes ``<name>`` only through
:func:`commit_directory`:

1. fsync every file in the temp directory;
2. write ``manifest.json`` (sizes and CRC-32s) atomically, fsync the directory;
3. if ``<name>`` exists, move it aside to ``<name>.replaced``;
4. rename ``<name>.tmp`` → ``<name>``, fsync the parent;
5. delete ``<name>.replaced``.

Deletion (:func:`retire`) renames to ``<name>.deleting`` before removing. A crash leaves one
of: a ``.tmp`` or ``.deleting`` directory (never read, removed by :func:`remove_stale`),
or — between 3 and 4 — no ``<name>`` but a complete ``<name>.replaced``, which
:func:`recover_replaced` moves back. Nothing without a valid manifest is ever complete
(:func:`lightning_ett.durable.manifest.verify`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_ett.durable.files import fsync_path, remove_path
from lightning_ett.durable.manifest import verify, write_manifest

TMP_SUFFIX = ".tmp"
REPLACED_SUFFIX = ".replaced"
DELETING_SUFFIX = ".deleting"

#: Test hook: called with the name of each step of a commit, so tests can crash between steps.
_crash_point: Callable[[str], None] | None = None


def temp_path(final: Path) -> Path:
    return final.with_name(final.name + TMP_SUFFIX)


def discard_unfinished(tmp: Path) -> None:
    """Delete the ``.tmp`` of a write or commit that failed, at once (best effort): never committed, so never read,
    and on a full disk its space is what the next save needs (:func:`remove_stale` would wait for the next start)."""
    with contextlib.suppress(OSError):
        remove_path(tmp)


def replaced_path(final: Path) -> Path:
    return final.with_name(final.name + REPLACED_SUFFIX)


def _reached(step: str) -> None:
    if _crash_point is not None:
        _crash_point(step)


def commit_directory(tmp: Path, final: Path, format_tag: str, fields: dict[str, Any],
                     skip: frozenset[str] = frozenset(), known: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """Make the fully written ``tmp`` the durable, complete directory ``final``; returns its manifest.

    ``known``: files' (size, CRC-32) summed while they were written (see :func:`write_manifest`).
    """
    for f in tmp.iterdir():
        if f.is_file():
            fsync_path(f)
    _reached("files_synced")
    manifest = write_manifest(tmp, format_tag, fields, skip, known)
    fsync_path(tmp)
    _reached("manifest_written")
    aside = replaced_path(final)
    if final.exists():  # an older copy under the same name: kept until the new one is in place
        remove_path(aside)
        os.replace(final, aside)
        _reached("old_moved_aside")
    os.replace(tmp, final)
    fsync_path(final.parent)
    _reached("renamed")
    remove_path(aside)
    return manifest


def retire(final: Path) -> None:
    """Delete a committed directory: renamed to ``<name>.deleting`` first, so a half-deleted one never keeps its name.

    Already gone is fine (two retention passes may pick the same directory).
    """
    doomed = final.with_name(final.name + DELETING_SUFFIX)
    remove_path(doomed)  # a crashed earlier deletion of the same name
    try:
        os.replace(final, doomed)
    except FileNotFoundError:
        return
    remove_path(doomed)


def recover_replaced(final: Path, format_tag: str) -> str | None:
    """Undo a crash between moving ``final`` aside and renaming its replacement into place.

    If ``final`` is missing and its ``.replaced`` copy is complete, the copy moves back.
    If ``final`` exists, a leftover ``.replaced`` copy is deleted. Returns what was done.
    """
    aside = replaced_path(final)
    if not aside.exists():
        return None
    if final.exists():
        remove_path(aside)
        return f"deleted the leftover copy {str(aside)!r}"
    if verify(aside, format_tag, checksums=False) is None:
        os.replace(aside, final)
        fsync_path(final.parent)
        return f"restored {str(final)!r} from {str(aside)!r} (a crash interrupted its replacement)"
    return None


def remove_stale(root: Path, pattern: str, format_tag: str) -> list[str]:
    """After a crash: of the names matching ``pattern``, delete ``.tmp``/``.deleting`` directories, settle ``.replaced`` ones."""
    done: list[str] = []
    if not root.is_dir():
        return done
    for leftover in [*root.glob(pattern + TMP_SUFFIX), *root.glob(pattern + DELETING_SUFFIX)]:
        remove_path(leftover)
        done.append(f"deleted the unfinished {str(leftover)!r}")
    for aside in root.glob(pattern + REPLACED_SUFFIX):
        final = aside.with_name(aside.name[: -len(REPLACED_SUFFIX)])
        if (said := recover_replaced(final, format_tag)) is not None:
            done.append(said)
    return done
