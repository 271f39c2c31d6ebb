"""Manifests: the size and CRC-32 of every file of a committed directory, written last.

A directory is *complete* only when its manifest is valid and every file it lists has the
listed size (and checksum). CRC-32 (2 GB/s here, ~2x sha256) detects truncation and bit rot,
not tampering. Checkpoints and published models share this format (with their own
``format`` tag).
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from pathlib import Path
from typing import Any

from lightning_ett.durable.files import atomic_write_json

MANIFEST_FILE = "manifest.json"


def crc32_of(path: Path, drop_cache: bool = False) -> int:
    """CRC-32 of a file, in one C call over a memory map where the filesystem allows it.

    One call releases the GIL once for the whole file instead of handing it back and forth
    with the training thread per chunk. ``drop_cache``: the checksum is the last read of a
    freshly written (fsynced, clean) file, so its pages leave the page cache: cached
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
        if drop_cache:
            _drop_pages(f.fileno())
        return crc


def _drop_pages(fd: int) -> None:
    """Evict an open, fsynced file's pages from the page cache; only an optimization."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


class ChecksummingWriter:
    """A binary file that computes the CRC-32 and size of what is written to it, as it is written.

    Why: checksumming after the write means reading every byte back (and mapping every page
    of it), CPU that a background checkpoint takes from training. Here the bytes are summed
    while they are still in the cache. Only sequential writes are summed: after a ``seek``
    :attr:`checksum` is ``None`` and the file must be read back.
    """

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._crc = 0
        self._size = 0
        self._sequential = True

    def write(self, data: Any) -> int:
        written = self._raw.write(data)
        view = memoryview(data).cast("B")
        if written is None or written != view.nbytes:
            self._sequential = False  # a short write (a non-blocking file): read it back instead
        else:
            self._crc = zlib.crc32(view, self._crc)
            self._size += written
        return written

    def seek(self, *args: Any) -> int:
        self._sequential = False
        return self._raw.seek(*args)

    @property
    def checksum(self) -> tuple[int, int] | None:
        """(size, CRC-32) of the bytes written, or ``None`` if they were not written in one sequential pass."""
        return (self._size, self._crc) if self._sequential else None

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...: the file's own
        return getattr(self._raw, name)


def drop_from_cache(path: Path) -> None:
    """Evict a written, fsynced file's pages from the page cache (see :func:`crc32_of`); only an optimization."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        _drop_pages(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, format_tag: str, fields: dict[str, Any],
                   skip: frozenset[str] = frozenset(), known: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """Checksum every file in ``directory`` (already fsynced) and write the manifest, durably.

    ``known``: (size, CRC-32) of files summed as they were written (:class:`ChecksummingWriter`);
    used when the file still has that size, else the file is read back.
    """
    files = {}
    for f in sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST_FILE and p.name not in skip):
        size = f.stat().st_size
        summed = (known or {}).get(f.name)
        crc = summed[1] if summed is not None and summed[0] == size else crc32_of(f, drop_cache=True)
        files[f.name] = {"bytes": size, "crc32": crc}
    manifest = {"format": format_tag, **fields, "files": files}
    atomic_write_json(directory / MANIFEST_FILE, manifest)
    return manifest


def read_manifest(directory: Path, format_tag: str) -> dict[str, Any] | None:
    """The manifest of ``directory`` if it is valid JSON of the right format, else ``None``."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    valid = isinstance(manifest, dict) and manifest.get("format") == format_tag and isinstance(manifest.get("files"), dict)
    return manifest if valid else None


def verify(directory: Path, format_tag: str, checksums: bool = True) -> str | None:
    """``None`` if ``directory`` is complete, else what is wrong with it, naming the file (relative to ``directory``)."""
    manifest = read_manifest(directory, format_tag)
    if manifest is None:
        return f"no valid {MANIFEST_FILE} (never completed)"
    try:
        for name, expected in manifest["files"].items():
            path = directory / name
            if not path.is_file():
                return f"{name} is missing"
            size = path.stat().st_size
            if size != expected["bytes"]:
                return f"{name} has {size} bytes, the manifest says {expected['bytes']} (truncated?)"
            if checksums and crc32_of(path) != expected["crc32"]:
                return f"{name} fails its CRC-32 check (corrupted)"
    except (OSError, KeyError, TypeError) as e:
        return f"cannot be checked ({type(e).__name__}: {e})"
    return None
