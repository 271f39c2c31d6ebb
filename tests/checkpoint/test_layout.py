"""Choosing the checkpoint to resume from, retention, and what a loader accepts: plain files, no training."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from lightning_ett.checkpoint import layout as fmt
from lightning_ett.checkpoint.adopt import adopt
from lightning_ett.durable.commit import commit_directory, temp_path

LEGACY = Path(__file__).resolve().parent.parent / "fixtures" / "v0_1_0"


def fake_checkpoint(root: Path, step: int, seq: int, payload: bytes = b"tensor bytes") -> Path:
    final = root / fmt.checkpoint_name(step)
    tmp = temp_path(final)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(payload)
    torch.save({"global_step": step}, tmp / fmt.META_FILE)
    commit_directory(tmp, final, fmt.FORMAT, {"global_step": step, "time": time.time(), "seq": seq})
    return final


def test_the_newest_commit_wins_not_the_highest_step(tmp_path):
    for step, seq in ((4, 1), (8, 2), (12, 3), (6, 4)):  # step 6: a rolled-back line, committed last
        fake_checkpoint(tmp_path, step, seq)
    assert [e.step for e in fmt.committed(tmp_path)] == [4, 8, 12, 6]
    assert fmt.newest_complete(tmp_path).name == fmt.checkpoint_name(6)
    assert fmt.next_seq(fmt.committed(tmp_path)) == 5


def test_damaged_checkpoints_are_skipped_with_a_warning_naming_the_file(tmp_path):
    fake_checkpoint(tmp_path, 4, 1)
    eight = fake_checkpoint(tmp_path, 8, 2)
    twelve = fake_checkpoint(tmp_path, 12, 3)
    (twelve / "__0_0.distcp").write_bytes(b"tensor")  # truncated
    (eight / "__0_0.distcp").write_bytes(b"TENSOR BYTES")  # same size, other bytes
    (tmp_path / "step-000000016.tmp").mkdir()  # never committed: never a candidate
    with pytest.warns(UserWarning) as warned:
        chosen = fmt.newest_complete(tmp_path)
    assert chosen.name == fmt.checkpoint_name(4)
    messages = [str(w.message) for w in warned]
    assert f"Skipping checkpoint {str(twelve)!r}: __0_0.distcp has 6 bytes, the manifest says 12 (truncated?)" in messages[0]
    assert "__0_0.distcp fails its CRC-32 check" in messages[1]
    assert fmt.newest_complete(tmp_path / "absent") is None


def test_retention_keeps_the_newest_commits_and_pinned_ones(tmp_path):
    entries = [fmt.CheckpointEntry(fake_checkpoint(tmp_path, s, q), s, q) for s, q in ((2, 1), (4, 2), (6, 3), (8, 4))]
    assert [e.step for e in fmt.to_delete(entries, keep_last_n=2)] == [2, 4]
    (entries[1].path / fmt.PIN_FILE).touch()  # ModelPublisher reads it
    assert [e.step for e in fmt.to_delete(entries, keep_last_n=2)] == [2]
    assert fmt.to_delete(entries, keep_last_n=None) == [] and fmt.to_delete(entries, keep_last_n=10) == []
    assert fmt.to_delete(entries, keep_last_n=1)[-1].step == 6  # never the newest


def test_an_explicit_path_must_be_complete_and_the_error_names_the_file(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 4, 1)
    assert fmt.require_complete(ckpt) == ckpt
    (ckpt / fmt.META_FILE).write_bytes(b"half")
    with pytest.raises(FileNotFoundError, match=f"{str(ckpt)!r} is not a complete checkpoint: lightning.pt has 4 bytes"
                       ) as torn:
        fmt.require_complete(ckpt)
    with pytest.raises(FileNotFoundError, match="'.*nothing-here' does not exist: the ckpt_path names no checkpoint") as missing:
        fmt.require_complete(tmp_path / "nothing-here")
    # The checkpoint directory itself (a new-user trial: it said "never completed"): the error names the newest one.
    newest = fake_checkpoint(tmp_path / "dir", 8, 1)
    with pytest.raises(FileNotFoundError, match=f"a directory of checkpoints: pass one of them, e.g. the newest, "
                                                f"{str(newest)!r}"):
        fmt.require_complete(tmp_path / "dir")
    from lightning_ett.launch.worker import not_retryable

    assert not_retryable(torn.value) and not_retryable(missing.value)  # the same files fail every attempt: not retried


def test_a_legacy_checkpoint_without_manifest_is_refused_until_adopted(tmp_path):
    legacy = tmp_path / "step6.ckpt"
    shutil.copytree(LEGACY / "sharded_ckpt" / "step6.ckpt", legacy)
    with pytest.raises(FileNotFoundError, match=r"no valid manifest\.json.*python -m lightning_ett\.checkpoint\.adopt"):
        fmt.require_complete(legacy)
    manifest = adopt(legacy)
    assert manifest["global_step"] == 6 and {"lightning.pt", ".metadata"} <= set(manifest["files"])
    assert fmt.require_complete(legacy) == legacy and fmt.read_meta(legacy)["global_step"] == 6
    with pytest.raises(FileExistsError):
        adopt(legacy)


def test_a_crash_mid_replacement_loads_the_previous_copy_without_touching_the_files(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 4, 1)
    aside = tmp_path / (ckpt.name + ".replaced")
    ckpt.rename(aside)  # what a crash between "moved aside" and "renamed" leaves
    with pytest.warns(UserWarning, match="a crash interrupted its replacement"):
        assert fmt.require_complete(ckpt) == aside
    assert aside.is_dir() and not ckpt.exists()  # every rank calls it: it only reads
