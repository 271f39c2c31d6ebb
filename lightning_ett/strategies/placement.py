"""Device placement before sharding: dense parts to the device, tables left to the sharders."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection


def move_dense_to_device(module: nn.Module, device: torch.device) -> None:
    """Move materialized dense parameters and buffers to ``device``.

    Meta ones are DMP's to materialize, and embedding tables stay where they are: the
    sharders allocate each rank's shard on the device (moving whole tables would not fit).
    DMP does not move dense parameters itself.
    """
    if device.type == "cpu":
        return
    tables = {
        id(t) for sub in module.modules() if isinstance(sub, (EmbeddingBagCollection, EmbeddingCollection))
        for t in list(sub.parameters()) + list(sub.buffers())
    }
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and id(param) not in tables and param.device.type not in ("meta", device.type):
                sub._parameters[name] = nn.Parameter(param.to(device), requires_grad=param.requires_grad)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and id(buffer) not in tables and buffer.device.type not in ("meta", device.type):
                sub._buffers[name] = buffer.to(device)
