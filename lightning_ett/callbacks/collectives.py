"""The callbacks' collectives: an all-gather without Lightning's deprecated path, and agreement on flags and errors.

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

from lightning_ett.durable.errors import ANOTHER_RANKS_ERROR


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


def any_rank(trainer: pl.Trainer, *flags: bool | float) -> list[bool | float]:
    """Each value max-ed over all ranks (flags: OR-ed): one small all-reduce."""
    if trainer.world_size == 1:
        return list(flags)
    values = torch.tensor([float(f) for f in flags], dtype=torch.float64, device=trainer.strategy.root_device)
    reduced = trainer.strategy.reduce(values, reduce_op="max").tolist()
    return [bool(v) if isinstance(f, bool) else v for f, v in zip(flags, reduced)]


def raise_on_every_rank(trainer: pl.Trainer, error: BaseException | None, owner: str, what: str) -> None:
    """Raise ``error`` where it happened and an echo naming it on the other ranks, if any rank has one."""
    try:
        (failed,) = any_rank(trainer, error is not None)
    except Exception:
        if error is None:
            raise
        failed = True  # a rank stopped (often why this rank failed): this rank's own error, with its cause, says more
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{owner}: {what} {ANOTHER_RANKS_ERROR}.")
