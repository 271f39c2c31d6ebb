"""CompileCache's move of inductor's precompiled header: torn files, stale paths, a full disk (no compiler runs)."""

from __future__ import annotations

import functools
import shutil
from collections import namedtuple

import pytest
from torch._inductor import codecache
from torch.utils._filelock import FileLock

from lightning_ett.compile import headers
from lightning_ett.patching import Patches


def test_a_torn_header_is_removed_a_finished_one_and_one_being_built_are_kept(tmp_path):
    (tmp_path / "torn.h.gch").write_bytes(b"gpcWrite" + b"\0" * 64)  # g++ killed while writing it
    (tmp_path / "torn.h_CxxBuild").mkdir()
    (tmp_path / "empty.h.gch").write_bytes(b"")
    (tmp_path / "good.h.gch").write_bytes(b"gpch" + b"013" + b"\0" * 64)
    (tmp_path / "busy.h.gch").write_bytes(b"gpcWrite")
    (tmp_path / "locks").mkdir()
    with FileLock(str(tmp_path / "locks" / "busy.lock")):  # another process is building this one now
        removed = headers.remove_torn_headers(tmp_path)
    assert sorted(p.name for p in removed) == ["empty.h.gch", "torn.h.gch"]
    assert sorted(p.name for p in tmp_path.glob("*.gch")) == ["busy.h.gch", "good.h.gch"]
    assert not (tmp_path / "torn.h_CxxBuild").exists()


def test_the_patched_directory_does_not_outlive_the_patch(tmp_path, monkeypatch):
    # inductor's _precompile_header is functools.cache-d: a path it computed while patched must not survive undo.
    monkeypatch.setattr(codecache, "_precompile_header", functools.cache(lambda header: f"{codecache._HEADER_DIR}/{header}"))
    original = codecache._HEADER_DIR
    assert codecache._precompile_header("h") == f"{original}/h"
    patches = Patches()
    moved = headers.keep_precompiled_headers(patches, tmp_path / "precompiled_headers")
    assert moved is not None and moved.parent == tmp_path / "precompiled_headers" and moved.is_dir()
    assert codecache._precompile_header("h") == f"{moved}/h"
    assert codecache._HEADER_LOCK_DIR == str(moved / "locks")
    patches.undo()
    assert codecache._HEADER_DIR == original
    assert codecache._precompile_header("h") == f"{original}/h"


def test_a_nearly_full_disk_leaves_the_header_in_tmp_with_a_warning(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2**30, 10 * 2**30 - 100 * 2**20, 100 * 2**20))
    original = codecache._HEADER_DIR
    patches = Patches()
    with pytest.warns(UserWarning, match=r"stays in .*only 100 MiB are free"):
        assert headers.keep_precompiled_headers(patches, tmp_path / "h") is None
    assert codecache._HEADER_DIR == original and len(patches) == 0


def test_the_host_key_names_this_cpu_and_is_stable():
    key = headers.host_cpu_key()
    assert key == headers.host_cpu_key() and len(key) == 12 and int(key, 16) >= 0
