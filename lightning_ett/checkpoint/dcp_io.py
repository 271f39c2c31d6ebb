"""The package's calls into ``torch.distributed.checkpoint`` (DCP): write, read whole, load into targets.

One place so that the single-process case stays quiet without touching the process's
warning filters: DCP warns "assuming the intent is to save/load in a single process" on
every call without a process group. There this module calls what ``dcp.save``, ``dcp.load``
and ``_load_state_dict_from_keys`` call after that warning (``_save_state_dict``,
``_load_state_dict`` with ``no_dist=True``) directly. Not ``warnings.catch_warnings``: it
races other threads' filters (writes run on a background thread), and leaving it resets
Python's show-once registry, so every warning the process had shown once (torch's
deprecations at each save) is printed again.
"""

from __future__ import annotations

import io
import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_ett.durable.manifest import ChecksummingWriter, drop_from_cache


class _ChecksummingFileSystem(FileSystem):
    """DCP's local filesystem, summing each data file as it is written and evicting it from the page cache after."""

    def __init__(self) -> None:
        super().__init__()
        self.checksums: dict[str, tuple[int, int]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            summing = ChecksummingWriter(stream)
            yield cast(io.IOBase, summing)
        if summing.checksum is not None:
            self.checksums[Path(path).name] = summing.checksum
        drop_from_cache(Path(path))  # written and fsynced (sync_files=True): clean pages, not needed again


def write(state: dict[str, Any], directory: Path, group: Any | None = None, collective: bool = True,
          staged: bool = False) -> dict[str, tuple[int, int]]:
    """Write ``state`` into ``directory`` (every file fsynced). ``collective``: every rank of ``group`` writes its part.

    ``staged``: the tensors are CPU copies already (AsyncCheckpoint's buffers), so DCP's
    copy-ahead from the device is switched off (it would touch CUDA streams from a writer thread).
    Returns the (size, CRC-32) of the files this rank wrote, summed as they were written (the
    manifest's checksums, without reading the files back).

    An entry every rank holds (the dense model and its buffers) is written by ``group``'s rank 0, as
    Lightning checkpoints rank 0's state (so a model without sharded tables is written by rank 0 alone,
    as under DDP). DCP's default gives it to the rank with the least to write so far, and buffers the
    ranks keep apart (BatchNorm's running statistics: TorchRec's DDP does not broadcast buffers) would
    then come from that rank, and every rank would resume with its copy.
    """
    writer = FileSystemWriter(directory, sync_files=True, **({"per_thread_copy_ahead": 0} if staged else {}))
    writer.fs = filesystem = _ChecksummingFileSystem()
    if collective and _distributed():
        dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
                 process_group=group)
    else:
        from torch.distributed.checkpoint.state_dict_saver import _save_state_dict, _stateful_to_state_dict

        _save_state_dict(state_dict=_stateful_to_state_dict(state), storage_writer=writer, no_dist=True)
    return {name: summed for name, summed in filesystem.checksums.items() if (directory / name).is_file()}


def read_whole(directory: Path, key: str) -> dict[str, Any]:
    """Entry ``key`` of a checkpoint with every tensor whole (sharded tables gathered), in this process's memory.

    DCP's metadata knows each tensor's full shape. ``_load_state_dict_from_keys`` is private
    but is what ``dcp_to_torch_save`` uses; the public function would read every entry.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict, _load_state_dict_from_keys

    if _distributed():
        return _load_state_dict_from_keys(keys={key}, checkpoint_id=str(directory))[key]
    state: dict[str, Any] = {}
    _load_state_dict(state_dict=state, storage_reader=FileSystemReader(directory), no_dist=True,
                     planner=_EmptyStateDictLoadPlanner(keys={key}))
    return state[key]


def load_into(target: dict[str, Any], directory: Path, partial: bool = False) -> None:
    """Fill ``target``'s tensors (sharded ones included, resharded as needed) from the checkpoint.

    ``partial``: a target entry the checkpoint lacks keeps its value (Lightning's ``strict_loading=False``).
    """
    planner = DefaultLoadPlanner(allow_partial_load=partial)
    if _distributed():
        dcp.load(target, checkpoint_id=str(directory), planner=planner)
        return
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state_dict=target, storage_reader=FileSystemReader(directory), planner=planner,
                     no_dist=True)  # in place: plain dicts


def saved_keys(directory: Path) -> set[str]:
    """The flattened keys (``fused.state.<param>.<state>``) of every entry a DCP checkpoint holds, from its metadata."""
    return set(FileSystemReader(directory).read_metadata().state_dict_metadata)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
