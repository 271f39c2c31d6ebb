"""Process-group creation for ETTStrategy (run in the background by :mod:`.overlap`)."""

from __future__ import annotations

import atexit
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _get_default_process_group_backend_for_device,
)
from torch.distributed.constants import default_pg_timeout

# Long enough for a worker thread already waiting for the GIL to take it and finish (it needs
# microseconds once scheduled), short enough to be invisible in a job's shutdown.
EXIT_DRAIN_S = 0.05


def default_backend(device: torch.device) -> str:
    """``gloo`` on CPU; on GPUs NCCL plus a gloo CPU group, which background checkpoint writers need."""
    if device.type == "cuda":
        return "cpu:gloo,cuda:nccl"
    return _get_default_process_group_backend_for_device(device)


def init_process_group(
    env: ClusterEnvironment, backend: str, rank: int, world_size: int, device: torch.device, timeout: timedelta | None
) -> None:
    """``init_process_group`` with eager NCCL init and a per-attempt key space under torchelastic."""
    if dist.is_initialized():
        return
    os.environ["MASTER_ADDR"] = env.main_address
    os.environ["MASTER_PORT"] = str(env.main_port)
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL init: the communicator forms in the overlapped window
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # A restarted attempt must not read the dead attempt's addresses from the agent's store.
        store = dist.TCPStore(env.main_address, env.main_port, world_size, False, timeout=timeout or default_pg_timeout)
        kwargs["store"] = dist.PrefixStore(f"lightning_ett/attempt_{restart}", store)
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    atexit.unregister(release_at_exit)  # once per process, however many fits create a group
    atexit.register(release_at_exit)


def release_at_exit() -> None:
    """Destroy the group this process created, then let its worker threads drain, before Python finalizes.

    Lightning registers the destroy only for a plain ``"nccl"`` backend, and ``ETTStrategy``'s
    ``"cpu:gloo,cuda:nccl"`` and ``"gloo"`` are not that. The drain is for a known PyTorch
    crash (pytorch/pytorch#38228): a collective that finished just before exit (an all-to-all
    of a forward run after ``fit``) is freed on a gloo worker thread, which needs the GIL to
    drop its tensors' Python objects. If Python is finalizing by then, the thread is unwound
    through a ``noexcept`` destructor and the whole process aborts with "terminate called
    without an active exception", after the job itself has succeeded. Sleeping releases the GIL.
    Destroying the group does not join those threads while TorchRec's modules still hold it.
    """
    _destroy_dist_connection()
    time.sleep(EXIT_DRAIN_S)
