"""FP8 training where no FP8 GPU is at hand: a Linear whose three GEMMs run as ``fp8_mm`` does.

``emulate_float8_training(model, module_filter_fn)`` swaps the selected ``nn.Linear`` layers
for :class:`EmulatedFloat8Linear`, which casts both operands of the forward GEMM and of both
backward GEMMs as torchao's recipe does (the same code FP8Probe measures with:
:func:`lightning_ett.fp8.cast.fp8_mm`) and keeps the rest (bias, outputs, gradients) in the
layer's own precision. It trains what torchao's ``convert_to_float8_training`` would train on
an FP8 GPU, up to accumulation order, on any device — slower, not faster. The signature
mirrors torchao's so that the same ``module_filter_fn`` serves both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_ett.fp8.cast import Gemm, Recipe, fp8_mm


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, recipe: Recipe) -> torch.Tensor:  # type: ignore[override]
        rows = x.reshape(-1, x.shape[-1])
        out = fp8_mm(rows, weight.t(), recipe, Gemm.OUTPUT, x.dtype)
        ctx.save_for_backward(rows, weight)
        ctx.recipe, ctx.input_shape = recipe, x.shape
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        rows, weight = ctx.saved_tensors
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_input = fp8_mm(grad_rows, weight, ctx.recipe, Gemm.GRAD_INPUT, grad_out.dtype).reshape(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = fp8_mm(grad_rows.t(), rows, ctx.recipe, Gemm.GRAD_WEIGHT, weight.dtype)
        return grad_input, grad_weight, None


class EmulatedFloat8Linear(nn.Linear):
    """An ``nn.Linear`` (the same parameters) whose GEMMs are FP8 as ``recipe`` casts them."""

    def __init__(self, linear: nn.Linear, recipe: str = "tensorwise") -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.recipe = Recipe.from_torchao(recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Fp8LinearFunction.apply(x, self.weight, self.recipe)
        return out + self.bias if self.bias is not None else out


def emulate_float8_training(model: nn.Module, module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
                            recipe: str = "tensorwise") -> list[str]:
    """Swap every ``nn.Linear`` in ``model`` that ``module_filter_fn(module, fqn)`` selects; return their fqns."""
    swapped = []
    for fqn, module in list(model.named_modules()):
        if type(module) is not nn.Linear or (module_filter_fn is not None and not module_filter_fn(module, fqn)):
            continue
        parent_name, _, name = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, name, EmulatedFloat8Linear(module, recipe))
        swapped.append(fqn)
    return swapped
