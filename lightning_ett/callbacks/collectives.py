"""The one all-gather the callbacks make, without Lightning's deprecated path.

``Strategy.all_gather`` goes through ``torch.distributed.nn.functional.all_gather`` (autograd
support the callbacks do not need), which torch deprecates with a FutureWarning at every call
site; silencing it with ``warnings.catch_warnings`` resets Python's show-once registry, so every
warning shown once before is printed again. ``torch.distributed.all_gather`` is what that
function calls underneath: the same collective on gloo and NCCL, and no warning.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.distributed as dist


def all_gather(trainer: pl.Trainer, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` of every rank, stacked: ``[world_size, *tensor.shape]`` (``[1, ...]`` in one process).

    ``tensor`` is moved to the strategy's device first (NCCL gathers device tensors); the result
    stays there. Every rank of the default group must call it.
    """
    tensor = tensor.to(trainer.strategy.root_device).contiguous()
    if not (dist.is_available() and dist.is_initialized()) or trainer.world_size == 1:
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.stack(parts)
