"""FP8 GEMMs as torchao's float8 training recipes compute them, and what casting to FP8 loses.

A recipe says, for each operand of each of a Linear's three GEMMs, the FP8 dtype and the
scaling granularity: torchao's ``Float8LinearConfig.from_recipe_name`` is read, not copied.

* ``tensorwise``: one scale per tensor; inputs and weights in e4m3, gradients in e5m2.
* ``rowwise``: one scale per row of the left operand and per column of the right one (the
  reduction dimension is scaled per slice), every operand in e4m3 (torchao's choice for this
  recipe, gradients included), scales rounded down to powers of two.

Scales and casts are torchao's (``tensor_to_scale``, ``to_fp8_saturated``). The GEMM runs
as ``torch._scaled_mm`` where the backend has it for the shape (CPU in torch 2.13: every shape;
CUDA: dimensions divisible by 16 on FP8-capable GPUs); elsewhere as the exact emulation —
dequantize each operand (FP8 value / scale, in float32) and multiply in float32 — which is
what the FP8 kernel computes up to float32 accumulation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torchao.float8.config import Float8LinearConfig, ScalingGranularity
from torchao.float8.float8_utils import compute_error, tensor_to_scale, to_fp8_saturated

RECIPES = ("tensorwise", "rowwise")


class Gemm(str, Enum):
    """A Linear's three GEMMs (``y = x Wᵀ``): what each multiplies."""

    OUTPUT = "output"  # x @ Wᵀ
    GRAD_INPUT = "grad_input"  # dy @ W
    GRAD_WEIGHT = "grad_weight"  # dyᵀ @ x


@dataclass(frozen=True)
class Operand:
    dtype: torch.dtype
    axiswise: bool  # one scale per slice along the reduction dimension, else per tensor
    power_of_2: bool


@dataclass(frozen=True)
class Recipe:
    """For each GEMM, how its left and right operands are cast."""

    name: str
    operands: dict[Gemm, tuple[Operand, Operand]]

    @classmethod
    def from_torchao(cls, name: str) -> Recipe:
        if name not in RECIPES:
            raise ValueError(f"FP8 recipe {name!r}: expected one of {list(RECIPES)} (torchao's float8 training recipes).")
        config = Float8LinearConfig.from_recipe_name(name)

        def operand(cast_config) -> Operand:  # type: ignore[no-untyped-def]
            return Operand(cast_config.target_dtype, cast_config.scaling_granularity is ScalingGranularity.AXISWISE,
                           config.round_scales_to_power_of_2)

        x, w, dy = config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output
        x_gw = config.cast_config_input_for_grad_weight
        w_gi = config.cast_config_weight_for_grad_input
        dy_gw = config.cast_config_grad_output_for_grad_weight
        return cls(name, {Gemm.OUTPUT: (operand(x), operand(w)), Gemm.GRAD_INPUT: (operand(dy), operand(w_gi)),
                          Gemm.GRAD_WEIGHT: (operand(dy_gw), operand(x_gw))})


@dataclass(frozen=True)
class Cast:
    """One operand in FP8: the FP8 values, their scale (FP8 = value x scale), and what the cast lost (when asked)."""

    data: torch.Tensor
    scale: torch.Tensor
    saturated: float | None = None  # share of elements at the FP8 maximum (clamped, or the amax itself)
    flushed: float | None = None  # share of non-zero elements that became zero

    def dequantized(self) -> torch.Tensor:
        return self.data.float() / self.scale


@dataclass(frozen=True)
class Rows:
    """A sample of a GEMM's M dimension (the rows of its activations), to bound what a measurement costs."""

    index: torch.Tensor
    of: int  # M


def cast(tensor: torch.Tensor, operand: Operand, reduction_dim: int, rows: Rows | None = None, m_dim: int | None = None,
         losses: bool = False) -> Cast:
    """``tensor`` (a GEMM operand reduced along ``reduction_dim``) in FP8, as torchao casts it.

    With ``rows``, only those rows along ``m_dim`` are cast, with the scale computed from the
    whole tensor, as the real cast would (a per-row scale of the sampled rows, a per-tensor or
    per-column scale over every row). ``losses`` counts the saturated and flushed shares.
    """
    hp = tensor.float()
    granularity = ScalingGranularity.AXISWISE if operand.axiswise else ScalingGranularity.TENSORWISE
    scale = tensor_to_scale(hp, operand.dtype, scaling_granularity=granularity,
                            axiswise_dim=reduction_dim if operand.axiswise else None,
                            round_scales_to_power_of_2=operand.power_of_2)
    if rows is not None and m_dim is not None:
        hp = hp.index_select(m_dim, rows.index)
        if scale.dim() and scale.shape[m_dim] == rows.of:
            scale = scale.index_select(m_dim, rows.index)
    scaled = hp * scale
    data = to_fp8_saturated(scaled, operand.dtype)
    if not losses:
        return Cast(data, scale)
    numel = max(hp.numel(), 1)
    saturated = float((scaled.abs() >= torch.finfo(operand.dtype).max).sum()) / numel
    flushed = float(((hp != 0) & (data.float() == 0)).sum()) / numel
    return Cast(data, scale, saturated, flushed)


def _scaled_mm_fits(a: Cast, b: Cast) -> bool:
    if a.data.device.type == "cpu":
        return True
    return a.data.device.type == "cuda" and all(d % 16 == 0 for d in (*a.data.shape, b.data.shape[1]))


def matmul(ca: Cast, cb: Cast) -> tuple[torch.Tensor, str]:
    """The FP8 product of two casts in float32, and which kernel computed it."""
    if _scaled_mm_fits(ca, cb):
        try:
            out = torch._scaled_mm(ca.data.contiguous(), cb.data.t().contiguous().t(), scale_a=ca.scale.reciprocal(),
                                   scale_b=cb.scale.reciprocal(), out_dtype=torch.float32)
            return out, "scaled_mm"
        except (RuntimeError, NotImplementedError):
            pass  # this backend lacks the kernel for these dtypes or layouts: the exact emulation below
    return ca.dequantized() @ cb.dequantized(), "emulated"


def fp8_mm(a: torch.Tensor, b: torch.Tensor, recipe: Recipe, gemm: Gemm) -> torch.Tensor:
    """``a @ b`` (``a``: [M, K], ``b``: [K, N]) in float32 with both operands in FP8 as ``recipe`` casts them for ``gemm``."""
    left, right = recipe.operands[gemm]
    out, _ = matmul(cast(a, left, reduction_dim=-1), cast(b, right, reduction_dim=0))
    return out


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB, torchao's definition (``compute_error``); +inf when exact."""
    return float(compute_error(reference.float(), approximation.float()))


def relative_error(sqnr: float) -> float:
    """‖reference − approximation‖ / ‖reference‖: the same quantity as the SQNR, ``10^(-SQNR/20)``."""
    return 10 ** (-sqnr / 20)
