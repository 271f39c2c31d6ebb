"""Small files that survive a crash, and directories checked before a job relies on them.

Every small file the package writes — summaries, ``job.json``, plan-cache entries, reports,
manifests, ``latest`` pointers, compile bundles — goes through :func:`atomic_write_bytes`:
readers see the old content or the new one, never a torn file.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any


def fsync_path(path: Path) -> None:
    """fsync a file or directory (a directory's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write to a unique temp name beside ``path``, fsync, rename, fsync the directory.

    The temp name is unique per process and call (nodes in containers may share a pid), so
    concurrent writers of one path never write into each other's temp file; the last rename wins.
    """
    path = Path(path)
    part = path.with_name(f".{path.name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(part, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1) -> Path:
    return atomic_write_bytes(path, (json.dumps(obj, indent=indent) + "\n").encode())


def set_aside(path: Path) -> Path:
    """Move a damaged file or directory out of the way under a name no reader picks up; returns it.

    Kept rather than deleted: the user may want to see what was wrong with it.
    """
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
    os.replace(path, aside)
    return aside


def remove_path(path: Path) -> None:
    """Delete a directory tree or a file, if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def writable_dir_error(directory: Path, argument: str, rank: int = 0) -> PermissionError | None:
    """Create ``directory`` and a probe file in it; the error to raise (naming ``argument``) if that fails."""
    probe = directory / f".write-probe-{rank}-{uuid.uuid4().hex[:8]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return PermissionError(f"{argument}={str(directory)!r}) is not writable ({e.strerror or e}); "
                               "pass a directory this job can create files in.")
    return None
