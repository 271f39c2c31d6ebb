"""What is in a batch: its tensors, its size, and marking its batch dimension dynamic before Dynamo specializes on it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from lightning_ett.patching import Patches

_MAX_DEPTH = 6


def batch_leaves(batch: Any) -> Iterator[Any]:
    """The tensors and KeyedJaggedTensors in ``batch`` — inside dicts, lists, tuples and dataclasses such as
    TorchRec's ``Batch`` — in order, to a bounded depth."""

    def visit(obj: Any, depth: int) -> Iterator[Any]:
        if depth > _MAX_DEPTH or obj is None:
            return
        if isinstance(obj, torch.Tensor) or _is_kjt(obj):
            yield obj
        elif isinstance(obj, Mapping):
            for v in obj.values():
                yield from visit(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from visit(v, depth + 1)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                yield from visit(getattr(obj, f.name), depth + 1)

    yield from visit(batch, 0)


def mark_batch_dynamic(batch: Any, batch_dim: int = 0, size: int | None = None) -> int:
    """Mark ``batch_dim`` of every tensor in ``batch`` (and a KeyedJaggedTensor's values, lengths,
    weights and offsets) as dynamic; returns how many tensors were marked.

    ``maybe_mark_dynamic``: Dynamo compiles the dimension symbolically but may still specialize
    it without raising (``mark_dynamic`` would fail the step instead). Dimensions of size 0 or
    1 are left alone: Dynamo always specializes those. With ``size``, only a tensor whose
    ``batch_dim`` has that size is marked (a compiled module's inputs: which of them hold the batch).
    """
    marked = 0

    def mark(t: torch.Tensor, dim: int) -> None:
        nonlocal marked
        if t.dim() > dim and t.shape[dim] > 1:
            torch._dynamo.maybe_mark_dynamic(t, dim)
            marked += 1

    for leaf in batch_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            if size is None or (leaf.dim() > batch_dim and leaf.shape[batch_dim] == size):
                mark(leaf, batch_dim)
        else:
            for t in (leaf.values(), leaf.lengths(), leaf.weights_or_none(), leaf.offsets_or_none()):
                if t is not None:
                    mark(t, 0)  # jagged: the flat dimension varies with the batch and the id counts
    return marked


def batch_size(batch: Any, batch_dim: int = 0) -> int | None:
    """Samples in ``batch``: ``batch_dim`` of its first tensor (a KeyedJaggedTensor's stride); ``None`` without one."""
    for leaf in batch_leaves(batch):
        if not isinstance(leaf, torch.Tensor):
            return int(leaf.stride())
        if leaf.dim() > batch_dim:
            return int(leaf.shape[batch_dim])
    return None


def _is_kjt(obj: Any) -> bool:
    return type(obj).__name__ == "KeyedJaggedTensor" and hasattr(obj, "lengths")


def mark_compiled_inputs(root: nn.Module, patches: Patches, batch_size: Callable[[], int | None],
                         batch_dim: int, seen: set[int]) -> None:
    """Mark the batch dimension of what each compiled submodule of ``root`` is called with (``seen``: the ids of
    modules already wrapped; updated).

    Why: a mark on the batch does not carry through eager code. A compiled MLP fed
    ``torch.cat([dense, embeddings])`` gets a new tensor, specializes on the batch size and
    recompiles at a smaller last batch. So the call of each compiled module (``module.compile()``:
    its ``_compiled_call_impl``; ``torch.compile(module)``: an ``OptimizedModule``, through a
    forward pre-hook, which runs outside the compiled code) marks ``batch_dim`` of its tensor
    arguments that have the current batch's size (``batch_size()``; nothing while it is ``None``). A
    LightningModule given to ``fit`` as ``torch.compile(model)`` has neither: its compiled steps take
    the batch, marked already.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    def mark(args: Any, kwargs: Any) -> None:
        size = batch_size()
        if size is not None and size > 1:
            mark_batch_dynamic((args, kwargs), batch_dim, size=size)

    for module in compiled_submodules(root):
        compiled_call = module.__dict__.get("_compiled_call_impl")
        if id(module) in seen:
            continue
        if isinstance(module, OptimizedModule):
            handle = module.register_forward_pre_hook(lambda _m, args, kwargs: mark(args, kwargs), with_kwargs=True)
            patches.call_on_undo(handle.remove)
        elif compiled_call is not None:
            def marked_call(*args: Any, _compiled: Callable[..., Any] = compiled_call, **kwargs: Any) -> Any:
                mark(args, kwargs)
                return _compiled(*args, **kwargs)

            patches.setattr(module, "_compiled_call_impl", marked_call)
        seen.add(id(module))


def compiled_submodules(root: nn.Module) -> list[nn.Module]:
    """``root`` and its submodules that ``torch.compile`` wraps: ``module.compile()``-d ones (their
    ``_compiled_call_impl``), ``torch.compile(module)``'s ``OptimizedModule``, and a LightningModule
    given to ``fit`` as ``torch.compile(model)`` (Lightning unwraps it and keeps ``_compiler_ctx``). A
    function compiled with ``@torch.compile`` is not a module and is not found."""
    from torch._dynamo.eval_frame import OptimizedModule

    return [m for m in root.modules()
            if isinstance(m, OptimizedModule) or m.__dict__.get("_compiled_call_impl") is not None
            or getattr(m, "_compiler_ctx", None) is not None]
