"""Mark the batch dimension of everything in a batch dynamic, before Dynamo specializes on it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

_MAX_DEPTH = 6


def mark_batch_dynamic(batch: Any, batch_dim: int = 0) -> int:
    """Mark ``batch_dim`` of every tensor in ``batch`` (and a KeyedJaggedTensor's values, lengths,
    weights and offsets) as dynamic; returns how many tensors were marked.

    ``maybe_mark_dynamic``: Dynamo compiles the dimension symbolically but may still specialize
    it without raising (``mark_dynamic`` would fail the step instead). Dimensions of size 0 or
    1 are left alone: Dynamo always specializes those.
    """
    marked = 0

    def mark(t: torch.Tensor, dim: int) -> None:
        nonlocal marked
        if t.dim() > dim and t.shape[dim] > 1:
            torch._dynamo.maybe_mark_dynamic(t, dim)
            marked += 1

    def visit(obj: Any, depth: int) -> None:
        if depth > _MAX_DEPTH or obj is None:
            return
        if isinstance(obj, torch.Tensor):
            mark(obj, batch_dim)
        elif _is_kjt(obj):
            for t in (obj.values(), obj.lengths(), obj.weights_or_none(), obj.offsets_or_none()):
                if t is not None:
                    mark(t, 0)  # jagged: the flat dimension varies with the batch and the id counts
        elif isinstance(obj, Mapping):
            for v in obj.values():
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v, depth + 1)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                visit(getattr(obj, f.name), depth + 1)

    visit(batch, 0)
    return marked


def _is_kjt(obj: Any) -> bool:
    return type(obj).__name__ == "KeyedJaggedTensor" and hasattr(obj, "lengths")
