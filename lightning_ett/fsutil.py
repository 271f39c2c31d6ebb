"""Small filesystem helpers shared by the checkpoint writer and the compile cache: durable writes, checks."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or directory (a directory's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write, fsync, rename: readers see the old content or the new one, never a torn file."""
    part = path.with_name(f"{path.name}.part-{os.getpid()}")
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    fsync_path(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


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
