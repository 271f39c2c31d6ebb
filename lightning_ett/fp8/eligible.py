"""Whether a Linear's GEMMs can run an FP8 kernel *and* gain from it: torchao's own shape rules.

``torchao.float8._auto_filter_for_recipe`` (torchao's experimental auto filter, the rules behind
its float8 README's performance tables, measured on H100) says, for ``nn.Linear(K, N)``
(weight ``[N, K]``):

* every recipe: ``K`` and ``N`` divisible by 16 (what the FP8 tensor cores accept);
* ``tensorwise``: not (``K <= 4096`` and ``N <= 1024``);
* ``rowwise``: ``N > 2048``, ``K > 1024``, and not (``N <= 4096`` and ``K <= 2048``).

Below those sizes the casts cost more than the faster GEMM saves. The batch size does not
enter: on other GPUs the break-even differs, so treat ``eligible`` as torchao's H100 verdict.
"""

from __future__ import annotations

from torch import nn
from torchao.float8.float8_linear_utils import _auto_filter_for_recipe


def eligible(module: nn.Module, fqn: str, recipe: str) -> bool:
    return isinstance(module, nn.Linear) and bool(_auto_filter_for_recipe(recipe, [])(module, fqn))


def gemm_flops(rows: float, in_features: int, out_features: int) -> float:
    """FLOPs of a Linear's three GEMMs (output, grad input, grad weight) for ``rows`` input rows."""
    return 3 * 2 * rows * in_features * out_features
