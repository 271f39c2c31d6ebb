"""The package's calls into ``torch.distributed.checkpoint`` (DCP): write, read whole, load into targets.

One place so that the single-process case stays quiet without touching the process's
warning filters: DCP warns "assuming the intent is to save/load in a single process" on
every call without a process group. Writes call DCP's ``_save_state_dict`` (what
``dcp.save`` calls after that warning) directly, since they run on a background thread,
where ``warnings.catch_warnings`` would race the training thread's filters; whole-tensor
reads run on the calling thread inside ``catch_warnings``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

_SINGLE_PROCESS = ".*assuming the intent is to (save|load) in a single process"


def write(state: dict[str, Any], directory: Path, group: Any | None = None, collective: bool = True,
          staged: bool = False) -> None:
    """Write ``state`` into ``directory`` (every file fsynced). ``collective``: every rank of ``group`` writes its part.

    ``staged``: the tensors are CPU copies already (AsyncCheckpoint's buffers), so DCP's
    copy-ahead from the device is switched off (it would touch CUDA streams from a writer thread).
    """
    writer = FileSystemWriter(directory, sync_files=True, **({"per_thread_copy_ahead": 0} if staged else {}))
    if collective and dist.is_available() and dist.is_initialized():
        dcp.save(state, storage_writer=writer, process_group=group)
        return
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict, _stateful_to_state_dict

    _save_state_dict(state_dict=_stateful_to_state_dict(state), storage_writer=writer, no_dist=True)


def read_whole(directory: Path, key: str) -> dict[str, Any]:
    """Entry ``key`` of a checkpoint with every tensor whole (sharded tables gathered), in this process's memory.

    DCP's metadata knows each tensor's full shape. ``_load_state_dict_from_keys`` is private
    but is what ``dcp_to_torch_save`` uses; the public function would read every entry.
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        return _load_state_dict_from_keys(keys={key}, checkpoint_id=str(directory))[key]


def load_into(target: dict[str, Any], directory: Path) -> None:
    """Fill ``target``'s tensors (sharded ones included, resharded as needed) from the checkpoint."""
    if dist.is_available() and dist.is_initialized():
        dcp.load(target, checkpoint_id=str(directory))
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        dcp.load(target, checkpoint_id=str(directory))
