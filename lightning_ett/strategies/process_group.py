"""Process-group creation for ETTStrategy (run in the background by :mod:`.overlap`)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from torch.distributed.constants import default_pg_timeout


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
