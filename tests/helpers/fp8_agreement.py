"""One Linear's GEMMs as FP8Probe predicts their SQNR and as torchao's own Float8Linear gives it, from the same tensors.

Shared by the unit test (a synthetic layer under each precision) and tests/scripts/fp8_job.py (every layer of the
trained planted model).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from lightning_ett.fp8.cast import Recipe, sqnr_db
from lightning_ett.fp8.probe import compute_dtype, measure_backward, measure_output, sample_forward


@dataclass(frozen=True)
class Agreement:
    predicted: dict[str, float]  # per GEMM, the probe's SQNR (dB)
    measured: dict[str, float]  # per GEMM, torchao's Float8Linear against the layer's own GEMM
    compute_dtype: torch.dtype  # the dtype the layer's GEMM ran in, as the probe read it
    output_dtypes: dict[str, torch.dtype]  # "reference" / "torchao": each output's dtype


def against_torchao(layer: nn.Linear, x: torch.Tensor, grad: torch.Tensor, recipe: str,
                    autocast: torch.dtype | None) -> Agreement:
    """``x``: the layer's input rows; ``grad``: the gradient of its output; ``autocast``: the CPU autocast dtype, or None.

    The GEMM alone is compared (a bias-free copy: an output rounded with a large bias in it would hide its error).
    torchao's Float8Linear reads CUDA's autocast state only ("hardcode to GPU's autocast dtype", float8_linear.py): on a
    GPU under mixed precision it casts its input to autocast's dtype first, so here it is given the input in that dtype.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    gemm_only = copy.deepcopy(layer)
    gemm_only.bias = None
    fp8 = convert_to_float8_training(nn.Sequential(copy.deepcopy(gemm_only)),
                                     config=Float8LinearConfig.from_recipe_name(recipe))[0]
    seen, dtypes = {}, {}
    dtype = x.dtype
    for name, lin in (("reference", gemm_only), ("torchao", fp8)):
        inp = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = lin(inp if name == "reference" or autocast is None else inp.to(autocast))
            if name == "reference":
                dtype = compute_dtype(inp, out)
        dtypes[name] = out.dtype
        out.backward(grad.to(out.dtype))
        seen[name] = {"output": out.detach(), "grad_input": inp.grad, "grad_weight": lin.weight.grad}
    r = Recipe.from_torchao(recipe)
    sample = sample_forward(x, layer.weight.detach(), dtype, r, None, torch.Generator())
    predicted = {"output": measure_output(sample, r).sqnr}
    predicted.update({m.gemm.value: m.sqnr for m in measure_backward(sample, grad.to(dtype), r, True, True)})
    measured = {g: sqnr_db(seen["reference"][g], seen["torchao"][g]) for g in predicted}
    return Agreement(predicted, measured, dtype, dtypes)
