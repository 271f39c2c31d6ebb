"""FP8 GEMMs as torchao's float8 training recipes compute them, and what casting to FP8 loses.

A recipe says, for each operand of each of a Linear's three GEMMs, the FP8 dtype and the
scaling granularity: torchao's ``Float8LinearConfig.from_recipe_name`` is read, not copied.

* ``tensorwise``: one scale per tensor; inputs and weights in e4m3, gradients in e5m2.
* ``rowwise``: one scale per row of the left operand and per column of the right one (the
  reduction dimension is scaled per slice), every operand in e4m3 (torchao's choice for this
  recipe, gradients included), scales rounded down to powers of two.

Scales and casts are torchao's (``amax_to_scale``, ``to_fp8_saturated``); the amax is taken with
``torch.aminmax``, which reads the tensor where it is (torchao's ``abs().max()`` makes a copy of
it first), so a sample costs no full-size copy of an activation. On CUDA the GEMM runs
as ``torch._scaled_mm`` where the GPU has FP8 and the shape fits (dimensions divisible by 16),
with ``use_fast_accum`` as torchao's config sets it per GEMM (on for the output GEMM); elsewhere
(CPU included, see :func:`_scaled_mm_fits`) as the exact emulation — dequantize
each operand (FP8 value / scale, in float32) and multiply in float32 — which is what the FP8
kernel computes up to accumulation order (and so cannot show fast accumulation's own error,
which on Hopper grows with K). The product is rounded to the layer's compute dtype, as
torchao's ``Float8Linear`` returns it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
from torchao.float8.config import Float8LinearConfig, ScalingGranularity
from torchao.float8.float8_utils import amax_to_scale, compute_error, to_fp8_saturated

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
    """For each GEMM, how its left and right operands are cast, and whether its kernel accumulates fast."""

    name: str
    operands: dict[Gemm, tuple[Operand, Operand]]
    fast_accum: dict[Gemm, bool]

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
                          Gemm.GRAD_WEIGHT: (operand(dy_gw), operand(x_gw))},
                   {Gemm.OUTPUT: config.gemm_config_output.use_fast_accum,
                    Gemm.GRAD_INPUT: config.gemm_config_grad_input.use_fast_accum,
                    Gemm.GRAD_WEIGHT: config.gemm_config_grad_weight.use_fast_accum})


@dataclass(frozen=True)
class Cast:
    """One operand in FP8: the FP8 values, their scale (FP8 = value x scale), and what the cast lost (when asked)."""

    data: torch.Tensor
    scale: torch.Tensor
    saturated: float | None = None  # share of elements at the FP8 maximum (clamped, or the amax itself)
    flushed: float | None = None  # share of non-zero elements that became zero

    def dequantized(self) -> torch.Tensor:
        return self.data.float() / self.scale


def amax(tensor: torch.Tensor, operand: Operand, reduction_dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The amax ``operand``'s scale is computed from (per slice along ``reduction_dim`` when axiswise), in float32.

    ``torch.aminmax`` reads ``tensor`` in place. ``dtype``: the dtype the GEMM really reads
    ``tensor`` in (autocast's); the amax is rounded to it, as the amax of the rounded tensor
    (rounding is monotonic), and only then widened.
    """
    if operand.axiswise:
        low, high = torch.aminmax(tensor, dim=reduction_dim, keepdim=True)
    else:
        low, high = torch.aminmax(tensor)
    return torch.maximum(low.abs(), high.abs()).to(dtype or tensor.dtype).float()


def cast(tensor: torch.Tensor, operand: Operand, reduction_dim: int, of: torch.Tensor | None = None,
         losses: bool = False) -> Cast:
    """``tensor`` (a GEMM operand reduced along ``reduction_dim``) in FP8, as torchao casts it.

    ``of``: the amax to scale by when ``tensor`` is a sample of the rows of the real operand
    (the scale of a per-tensor or per-column cast comes from every row, not only the sampled
    ones); by default, ``tensor``'s own. ``losses`` counts the saturated and flushed shares.
    """
    scale = amax_to_scale(amax(tensor, operand, reduction_dim) if of is None else of, operand.dtype,
                          round_scales_to_power_of_2=operand.power_of_2)
    scaled = tensor.float() * scale
    data = to_fp8_saturated(scaled, operand.dtype)
    if not losses:
        return Cast(data, scale)
    numel = max(scaled.numel(), 1)
    magnitude = scaled.abs()
    finfo = torch.finfo(operand.dtype)
    saturated = float(torch.count_nonzero(magnitude >= finfo.max)) / numel
    # round-to-nearest-even sends (0, half the smallest subnormal] to zero: the non-zero values the cast flushed
    half_subnormal = finfo.tiny * finfo.eps / 2
    flushed = float(torch.count_nonzero((magnitude <= half_subnormal) & (magnitude > 0))) / numel
    return Cast(data, scale, saturated, flushed)


def _scaled_mm_fits(a: Cast, b: Cast) -> bool:
    """CUDA only: there ``_scaled_mm`` is the FP8 kernel. torch's CPU ``_scaled_mm`` is a reference implementation
    of the emulation's arithmetic (dequantize, float32 GEMM) at ~10x its cost; both give the same numbers
    (``tests/test_fp8_probe.py`` checks it), so on CPU the probe emulates."""
    return a.data.device.type == "cuda" and all(d % 16 == 0 for d in (*a.data.shape, b.data.shape[1]))


def matmul(ca: Cast, cb: Cast, out_dtype: torch.dtype = torch.float32, use_fast_accum: bool = False
           ) -> tuple[torch.Tensor, str]:
    """The FP8 product of two casts in ``out_dtype``, and which kernel computed it."""
    if _scaled_mm_fits(ca, cb):
        try:
            out = torch._scaled_mm(ca.data.contiguous(), cb.data.t().contiguous().t(), scale_a=ca.scale.reciprocal(),
                                   scale_b=cb.scale.reciprocal(), out_dtype=out_dtype, use_fast_accum=use_fast_accum)
            return out, "scaled_mm"
        except (RuntimeError, NotImplementedError):
            pass  # this backend lacks the kernel for these dtypes or layouts: the exact emulation below
    return (ca.dequantized() @ cb.dequantized()).to(out_dtype), "emulated"


def fp8_mm(a: torch.Tensor, b: torch.Tensor, recipe: Recipe, gemm: Gemm, out_dtype: torch.dtype = torch.float32
           ) -> torch.Tensor:
    """``a @ b`` (``a``: [M, K], ``b``: [K, N]) with both operands in FP8 as ``recipe`` casts them for ``gemm``."""
    left, right = recipe.operands[gemm]
    out, _ = matmul(cast(a, left, reduction_dim=-1), cast(b, right, reduction_dim=0), out_dtype, recipe.fast_accum[gemm])
    return out


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB, torchao's definition (``compute_error``); +inf when exact (an
    all-zero GEMM included), NaN when the FP8 product is not finite (an overflow)."""
    value = float(compute_error(reference.float(), approximation.float()))
    if math.isnan(value) and bool(torch.isfinite(approximation).all()) and not bool(reference.any()):
        return math.inf if not bool(approximation.any()) else -math.inf  # 0 / 0: exact; signal 0, noise > 0: bad
    return value


def relative_error(sqnr: float) -> float:
    """‖reference − approximation‖ / ‖reference‖: the same quantity as the SQNR, ``10^(-SQNR/20)``."""
    return 10 ** (-sqnr / 20)
