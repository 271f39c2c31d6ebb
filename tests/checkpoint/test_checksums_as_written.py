"""The manifest's checksums are summed while DCP writes, and equal what reading the files back gives."""

from __future__ import annotations

import io

import torch

from lightning_ett.checkpoint import dcp_io
from lightning_ett.checkpoint import layout as fmt
from lightning_ett.durable.manifest import ChecksummingWriter, crc32_of, read_manifest, verify


def test_dcp_files_are_summed_as_written_and_the_sums_are_the_files_crcs(tmp_path):
    state = {"model": {"table": torch.randn(1000, 64), "bias": torch.arange(10.0)}, "step": 7}
    checksums = dcp_io.write(state, tmp_path / "ckpt.tmp", collective=False)
    data_files = sorted(p.name for p in (tmp_path / "ckpt.tmp").iterdir() if p.suffix == ".distcp")
    assert data_files and sorted(checksums) == data_files  # every data file; not the renamed .metadata.tmp
    for name, (size, crc) in checksums.items():
        path = tmp_path / "ckpt.tmp" / name
        assert (size, crc) == (path.stat().st_size, crc32_of(path))
    # The commit uses them; the manifest then verifies with a full read of every file.
    fmt.commit_checkpoint(tmp_path / "ckpt.tmp", tmp_path / "step-000000007", {"global_step": 7}, 7, known=checksums)
    assert verify(tmp_path / "step-000000007", fmt.FORMAT, checksums=True) is None
    manifest = read_manifest(tmp_path / "step-000000007", fmt.FORMAT)
    assert manifest is not None
    assert {n: manifest["files"][n]["crc32"] for n in checksums} == {n: c for n, (_, c) in checksums.items()}


def test_a_wrong_known_size_is_not_trusted(tmp_path):
    directory = tmp_path / "d.tmp"
    directory.mkdir()
    (directory / "a.bin").write_bytes(b"hello world")
    fmt.commit_checkpoint(directory, tmp_path / "step-000000001", {}, 1, known={"a.bin": (3, 12345)})
    assert verify(tmp_path / "step-000000001", fmt.FORMAT, checksums=True) is None  # read back: the right CRC


def test_a_seek_makes_the_writer_give_up_its_sum():
    raw = io.BytesIO()
    writer = ChecksummingWriter(raw)
    writer.write(b"abc")
    writer.write(memoryview(torch.arange(4, dtype=torch.int32).numpy()))  # any buffer, not only bytes
    assert writer.checksum is not None and writer.checksum[0] == 3 + 16 and writer.tell() == 19
    writer.seek(0)
    assert writer.checksum is None
