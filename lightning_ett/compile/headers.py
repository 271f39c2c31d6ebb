"""Inductor's precompiled C++ header, kept in CompileCache's directory: one per host CPU, never torn, never stale.

Why: inductor builds its CPU precompiled header (~150 MB, 5-8 s of g++ here) in
``<tempfile.gettempdir()>/torchinductor_<user>/precompiled_headers`` whatever
``TORCHINDUCTOR_CACHE_DIR`` says, and every new process asks for it before it looks up a cached
kernel, so a restart on a host with an empty ``/tmp`` rebuilt it although every kernel came from
the cache (#31: fit to first step 0.44 of cold). Inductor exposes no setting for this directory;
its module globals ``_HEADER_DIR``/``_HEADER_LOCK_DIR`` are the only handle (left alone, with a
warning, if a torch lacks them). Moving a file that inductor treats as "exists = good" onto
storage that outlives processes and is shared between hosts needs three guards inductor does
not have:

* **per host CPU**: the header's name hashes the compiler, its command line (which says
  ``-march=native``, not what it expands to) and the preprocessed header, so two CPUs with the
  same features but another ``-mtune`` share a name, and GCC silently refuses the other's
  header (every compile then parses the full header, ~3x slower, for good). Each CPU model and
  flag set gets its own sub-directory;
* **never torn**: g++ writes the ``.gch`` in place, so a job killed during the build leaves a
  truncated file that inductor would reuse forever (GCC ignores it: slow compiles on every
  restart). At setup, under inductor's own lock for that header, a ``.gch`` without GCC's
  ``gpch`` magic is removed, to be built again;
* **never stale**: ``_precompile_header`` is ``functools.cache``-d, so a path computed while the
  directory was patched would outlive the patch (and a deleted cache directory would break
  every later compile in the process); its cache is cleared when patching and when undoing.

The move is skipped (header left in ``/tmp``, with a warning) when the directory has less than
1 GiB free: a full disk must not turn a cache into a crash.
"""

from __future__ import annotations

import contextlib
import hashlib
import platform
import shutil
import warnings
from pathlib import Path

from lightning_ett.patching import Patches

GCC_PCH_MAGIC = b"gpch"  # a finished GCC precompiled header starts with it; one being written with b"gpcWrite"
MIN_FREE_BYTES = 1 << 30


def host_cpu_key() -> str:
    """A short hash of what ``-march=native`` expands to here: the CPU model and its feature flags."""
    model = flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
            if model and flags:
                break
    ident = f"{platform.machine()}|{model or platform.processor()}|{flags}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def remove_torn_headers(header_dir: Path) -> list[Path]:
    """Delete ``.gch`` files without GCC's magic (a build that was killed), each under inductor's lock for it."""
    from filelock import Timeout  # torch.utils._filelock.FileLock is filelock's, which inductor locks with
    from torch.utils._filelock import FileLock

    removed = []
    for gch in header_dir.glob("*.h.gch"):
        lock = header_dir / "locks" / f"{gch.name[: -len('.h.gch')]}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        try:
            with FileLock(str(lock), timeout=0):  # held: another process is building it right now; leave it
                if not _finished(gch):
                    gch.unlink()
                    shutil.rmtree(gch.with_name(gch.name[: -len(".gch")] + "_CxxBuild"), ignore_errors=True)
                    removed.append(gch)
        except (Timeout, OSError):
            continue
    return removed


def _finished(gch: Path) -> bool:
    with open(gch, "rb") as f:
        head = f.read(8)
    return head.startswith(GCC_PCH_MAGIC) and not head.startswith(b"gpcWrite")


def keep_precompiled_headers(patches: Patches, header_root: Path) -> Path | None:
    """Point inductor's precompiled headers at ``header_root/<host CPU>``; returns that directory (``None``: left in /tmp)."""
    from torch._inductor import codecache

    old_dir, old_lock_dir = getattr(codecache, "_HEADER_DIR", None), getattr(codecache, "_HEADER_LOCK_DIR", None)
    precompile = getattr(codecache, "_precompile_header", None)
    clear = getattr(precompile, "cache_clear", None)
    if not (isinstance(old_dir, str) and isinstance(old_lock_dir, str) and callable(clear)):
        warnings.warn("CompileCache: this torch keeps inductor's precompiled header where CompileCache cannot move it "
                      "(no codecache._HEADER_DIR); a host with an empty /tmp builds it again (~150 MB, seconds).",
                      stacklevel=3)
        return None
    header_dir = header_root / host_cpu_key()
    try:
        header_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(header_dir).free
    except OSError as e:
        warnings.warn(f"CompileCache: inductor's precompiled header stays in {old_dir!r}: {header_dir} is not usable "
                      f"({e.strerror or e}).", stacklevel=3)
        return None
    if free < MIN_FREE_BYTES:
        warnings.warn(f"CompileCache: inductor's precompiled header (~150 MB) stays in {old_dir!r}: only "
                      f"{free / 2**20:.0f} MiB are free under {header_dir} (1 GiB wanted).", stacklevel=3)
        return None
    remove_torn_headers(header_dir)
    clear()
    patches.call_on_undo(clear)  # after the globals are restored (undo runs last first): no path into our directory survives
    patches.setattr(codecache, "_HEADER_DIR", str(header_dir))
    patches.setattr(codecache, "_HEADER_LOCK_DIR", str(header_dir / "locks"))
    return header_dir
