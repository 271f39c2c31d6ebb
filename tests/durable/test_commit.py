"""The one commit protocol, crash points included, on plain files in a tmp dir (milliseconds each)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lightning_ett.durable import commit
from lightning_ett.durable.commit import (
    REPLACED_SUFFIX,
    commit_directory,
    recover_replaced,
    remove_stale,
    retire,
    temp_path,
)
from lightning_ett.durable.files import atomic_write_bytes, set_aside
from lightning_ett.durable.manifest import MANIFEST_FILE, crc32_of, read_manifest, verify

FORMAT = "test-format-v1"


class Crash(Exception):
    pass


def staged(final: Path, content: bytes = b"payload") -> Path:
    tmp = temp_path(final)
    tmp.mkdir(parents=True)
    (tmp / "data.bin").write_bytes(content)
    (tmp / "meta.pt").write_bytes(b"meta")
    return tmp


@pytest.fixture
def crash_at(monkeypatch):
    """Make the commit raise right after the named step, as a kill there would stop it."""
    def arm(point: str) -> None:
        def hook(step: str) -> None:
            if step == point:
                raise Crash(step)
        monkeypatch.setattr(commit, "_crash_point", hook)
    return arm


def test_a_commit_writes_a_manifest_with_sizes_and_checksums_and_renames(tmp_path):
    final = tmp_path / "ckpt"
    tmp = staged(final)
    manifest = commit_directory(tmp, final, FORMAT, {"global_step": 7})
    assert not tmp.exists() and final.is_dir()
    assert manifest["global_step"] == 7 and manifest["format"] == FORMAT
    assert manifest["files"]["data.bin"] == {"bytes": 7, "crc32": crc32_of(final / "data.bin")}
    assert read_manifest(final, FORMAT) == json.loads((final / MANIFEST_FILE).read_text())
    assert verify(final, FORMAT) is None


@pytest.mark.parametrize("point", ["files_synced", "manifest_written"])
def test_a_crash_before_the_rename_leaves_only_a_temp_directory_that_is_never_complete(tmp_path, crash_at, point):
    final = tmp_path / "ckpt"
    tmp = staged(final)
    crash_at(point)
    with pytest.raises(Crash):
        commit_directory(tmp, final, FORMAT, {})
    assert not final.exists() and tmp.exists()
    assert remove_stale(tmp_path, "ckpt", FORMAT) == [f"deleted the unfinished {str(tmp)!r}"]
    assert not tmp.exists()


def test_a_crash_while_replacing_keeps_the_old_copy_and_recovery_restores_it(tmp_path, crash_at):
    final = tmp_path / "last.ckpt"
    commit_directory(staged(final, b"old"), final, FORMAT, {"global_step": 1})
    crash_at("old_moved_aside")
    with pytest.raises(Crash):
        commit_directory(staged(final, b"new!"), final, FORMAT, {"global_step": 2})
    assert not final.exists() and (tmp_path / ("last.ckpt" + REPLACED_SUFFIX)).is_dir()
    said = recover_replaced(final, FORMAT)
    assert said is not None and "restored" in said
    assert (final / "data.bin").read_bytes() == b"old" and verify(final, FORMAT) is None


def test_a_crash_after_the_rename_leaves_the_new_copy_and_a_leftover_that_is_cleaned(tmp_path, crash_at):
    final = tmp_path / "last.ckpt"
    commit_directory(staged(final, b"old"), final, FORMAT, {})
    crash_at("renamed")
    with pytest.raises(Crash):
        commit_directory(staged(final, b"new!"), final, FORMAT, {})
    assert (final / "data.bin").read_bytes() == b"new!"
    assert remove_stale(tmp_path, "last.ckpt", FORMAT) == [f"deleted the leftover copy {str(tmp_path / 'last.ckpt.replaced')!r}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_an_incomplete_replaced_copy_is_not_restored(tmp_path):
    final = tmp_path / "x"
    aside = tmp_path / ("x" + REPLACED_SUFFIX)
    aside.mkdir()
    (aside / "data.bin").write_bytes(b"no manifest")
    assert recover_replaced(final, FORMAT) is None and not final.exists()


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: (d / "data.bin").write_bytes(b"pay"), "data.bin has 3 bytes, the manifest says 7 (truncated?)"),
    (lambda d: (d / "data.bin").write_bytes(b"PAYLOAD"), "data.bin fails its CRC-32 check (corrupted)"),
    (lambda d: (d / "data.bin").unlink(), "data.bin is missing"),
    (lambda d: (d / MANIFEST_FILE).write_text("{torn"), f"no valid {MANIFEST_FILE} (never completed)"),
    (lambda d: (d / MANIFEST_FILE).write_text('{"format": "another-v9", "files": {}}'), f"no valid {MANIFEST_FILE}"),
    (lambda d: (d / MANIFEST_FILE).write_text(json.dumps({"format": FORMAT, "files": {"data.bin": 3}})), "cannot be checked"),
])
def test_verify_names_the_file_that_fails(tmp_path, damage, message):
    final = tmp_path / "ckpt"
    commit_directory(staged(final), final, FORMAT, {})
    damage(final)
    problem = verify(final, FORMAT)
    assert problem is not None and message in problem


def test_retire_never_leaves_a_half_deleted_directory_under_its_name(tmp_path, monkeypatch):
    final = tmp_path / "v000001"
    commit_directory(staged(final), final, FORMAT, {})

    def interrupted(path: Path) -> None:
        if path.exists():
            raise Crash("killed while deleting")

    monkeypatch.setattr(commit, "remove_path", interrupted)
    with pytest.raises(Crash):
        retire(final)
    monkeypatch.undo()
    assert not final.exists() and (tmp_path / "v000001.deleting").exists()
    remove_stale(tmp_path, "v*", FORMAT)
    assert list(tmp_path.iterdir()) == []
    retire(final)  # already gone: nothing to do (two retention passes may pick the same one)


def test_atomic_write_replaces_whole_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "job.json"
    atomic_write_bytes(target, b"first")
    atomic_write_bytes(target, b"second")
    assert target.read_bytes() == b"second" and [p.name for p in tmp_path.iterdir()] == ["job.json"]
    with pytest.raises(IsADirectoryError):
        atomic_write_bytes(tmp_path, b"x")  # the directory itself: fails, and leaves nothing behind
    assert [p.name for p in tmp_path.iterdir()] == ["job.json"]


def test_set_aside_keeps_the_bad_file_under_a_name_no_reader_takes(tmp_path):
    bad = tmp_path / "plan-abc.pkl"
    bad.write_bytes(b"garbage")
    moved = set_aside(bad)
    assert not bad.exists() and moved.read_bytes() == b"garbage" and moved.name.startswith("plan-abc.pkl.corrupt-")
    assert os.path.dirname(moved) == str(tmp_path)
