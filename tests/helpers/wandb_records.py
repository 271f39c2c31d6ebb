"""Read what an offline W&B run wrote, straight from its ``run-<id>.wandb`` file.

wandb 0.31 ships no reader for offline runs and writes no summary JSON offline. The file is
a LevelDB-log-style stream (":W&B" header, 32 KiB blocks, 7-byte record headers) of
``wandb_internal_pb2.Record`` protobuf messages.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_HEADER = 7  # ":W&B" + uint16 magic + uint8 version
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a .wandb file (missing ':W&B' header)")
    pos, parts = _HEADER, []
    while pos + 7 <= len(data):
        block_left = _BLOCK - pos % _BLOCK
        if block_left < 7:  # trailer padding at a block's end
            pos += block_left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        chunk = data[pos : pos + length]
        pos += length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            parts = [chunk]
        elif kind == _MIDDLE:
            parts.append(chunk)
        elif kind == _LAST:
            parts.append(chunk)
            yield b"".join(parts)
        elif kind == 0 and length == 0:
            pos += block_left - 7  # zero padding
        else:
            break


def read_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    for payload in _payloads(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        yield record


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def history_rows(path: Path) -> list[dict[str, Any]]:
    return [
        {_key(item): json.loads(item.value_json) for item in record.history.item}
        for record in read_records(path)
        if record.WhichOneof("record_type") == "history"
    ]


def summary_values(path: Path) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                values[_key(item)] = json.loads(item.value_json)
    return values


def find_run_file(save_dir: Path) -> Path:
    files = sorted(Path(save_dir).glob("wandb/offline-run-*/run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no offline W&B run under {save_dir}")
    return files[-1]
