"""Heavy-tailed id streams for the checkpoint benchmarks: a truncated Zipf law over a table's rows.

Why not numpy's ``zipf``: it is not truncated (ids past the table would need rejection) and its
exponent must exceed 1 strictly; the inverse CDF over the table's rows is exact for any exponent.
"""

from __future__ import annotations

import torch


class ZipfLaw:
    """Row ``r`` (0-based rank) has probability ∝ ``(r + 1) ** -alpha``; the hot rows are scattered over the table
    by a fixed permutation (a real table's hot ids are not its first rows)."""

    def __init__(self, rows: int, alpha: float) -> None:
        self.rows = rows
        weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)
        self.cdf = torch.cumsum(weights, 0)
        self.cdf /= self.cdf[-1].clone()
        self.where = torch.randperm(rows, generator=torch.Generator().manual_seed(0))

    def rows_for(self, u: torch.Tensor) -> torch.Tensor:
        """The rows that uniform draws ``u`` in [0, 1) (float64) pick: the law's inverse CDF."""
        return self.where[torch.searchsorted(self.cdf, u).clamp_(max=self.rows - 1)]

    def from_uniform_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Map uniform ids in ``[0, rows)`` to this law (each id as the midpoint of its 1/rows of [0, 1))."""
        return self.rows_for((ids.to(torch.float64) + 0.5) / self.rows)
