"""What one sample of a Linear layer says about FP8, and a layer's record of its samples.

:func:`measure` takes a step's real operands — the layer's input rows, its weight, and the
gradient of its output — computes each of the three GEMMs in the layer's own precision and in
FP8 under every recipe, and returns the SQNRs and relative errors, the amaxes, and the shares
of values saturated and flushed to zero by the casts. :class:`LayerRecord` accumulates these
per layer as sums (and maxima) in a flat vector, so that every rank's records combine with one
all-gather at the end of fit (:func:`combine`). No Lightning here: the callback
(:class:`lightning_ett.callbacks.FP8Probe`) decides when to sample and where results go.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_ett.fp8.cast import RECIPES, Gemm, Recipe, Rows, cast, matmul, relative_error, sqnr_db
from lightning_ett.fp8.eligible import gemm_flops
from lightning_ett.fp8.stats import RunningStats

OPERANDS = ("input", "weight", "grad_output")
_KEEP_SAMPLES = 1000  # per layer, on each rank: the raw verdict samples (for the report and for checks)


@dataclass(frozen=True)
class Measurement:
    sqnr: dict[tuple[str, Gemm], float]
    rel_error: dict[tuple[str, Gemm], float]
    amax: dict[str, float]
    saturated: dict[str, float]  # per operand, under the verdict recipe's forward (input, weight) and grad-input casts
    flushed: dict[str, float]
    kernel: str

    def worst_db(self, recipe: str) -> float:
        return min(self.sqnr[(recipe, gemm)] for gemm in Gemm)


@torch.no_grad()
def measure(x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor, verdict_recipe: str, max_rows: int | None = None,
            generator: torch.Generator | None = None) -> Measurement:
    """``x``: [M, K] input rows, ``weight``: [N, K], ``grad_out``: [M, N]; the references in their own dtype.

    With ``max_rows`` below M, each GEMM is measured on that many randomly chosen rows (the scales
    still come from all M rows, as the real casts' do), so a sample costs the same at any batch size.
    """
    m = x.shape[0]
    pick = torch.randperm(m, generator=generator)[:max_rows].sort().values if max_rows and m > max_rows else None
    rows = Rows(pick.to(x.device), m) if pick is not None else None  # (the generator is a CPU one)

    def sampled(t: torch.Tensor, m_dim: int | None) -> torch.Tensor:
        return t.index_select(m_dim, rows.index) if rows is not None and m_dim is not None else t

    # per GEMM: (left operand, its M dim), (right operand, its M dim); each reduced along its inner dimension
    operands = {Gemm.OUTPUT: ((x, 0), (weight.t(), None)), Gemm.GRAD_INPUT: ((grad_out, 0), (weight, None)),
                Gemm.GRAD_WEIGHT: ((grad_out.t(), 1), (x, 0))}
    references = {g: sampled(a, ma) @ sampled(b, mb) for g, ((a, ma), (b, mb)) in operands.items()}
    sqnr, rel, kernel = {}, {}, "emulated"
    saturated: dict[str, float] = {}
    flushed: dict[str, float] = {}
    for name in RECIPES:
        recipe = Recipe.from_torchao(name)
        for gemm, ((a, ma), (b, mb)) in operands.items():
            left, right = recipe.operands[gemm]
            losses = name == verdict_recipe and gemm in (Gemm.OUTPUT, Gemm.GRAD_INPUT)
            ca = cast(a, left, reduction_dim=-1, rows=rows, m_dim=ma, losses=losses)
            cb = cast(b, right, reduction_dim=0, rows=rows, m_dim=mb, losses=losses and gemm is Gemm.OUTPUT)
            approx, kernel = matmul(ca, cb)
            sqnr[(name, gemm)] = sqnr_db(references[gemm], approx)
            rel[(name, gemm)] = relative_error(sqnr[(name, gemm)])
            if losses and gemm is Gemm.OUTPUT:
                saturated.update(input=ca.saturated, weight=cb.saturated)
                flushed.update(input=ca.flushed, weight=cb.flushed)
            elif losses:
                saturated["grad_output"], flushed["grad_output"] = ca.saturated, ca.flushed
    amax = {"input": float(x.abs().max()), "weight": float(weight.abs().max()), "grad_output": float(grad_out.abs().max())}
    return Measurement(sqnr, rel, amax, saturated, flushed, kernel)


@dataclass
class LayerRecord:
    """One layer's samples on this rank: the verdict statistic and the report's sums, as one flat vector."""

    fqn: str
    in_features: int
    out_features: int
    verdict: RunningStats = field(default_factory=RunningStats)
    gemms: dict[str, RunningStats] = field(default_factory=dict)  # "<recipe>/<gemm>/<sqnr_db|rel_error>"
    casts: dict[str, float] = field(default_factory=dict)  # "<saturated|flushed>/<operand>" sums over samples
    amax: dict[str, float] = field(default_factory=lambda: dict.fromkeys(OPERANDS, 0.0))
    rows: float = 0.0  # input rows seen, summed over forward passes observed (for the GEMM shape and FLOPs)
    passes: float = 0.0
    kernel: str = ""
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=_KEEP_SAMPLES))

    def add(self, m: Measurement, verdict_recipe: str) -> None:
        worst = m.worst_db(verdict_recipe)
        self.verdict.add(worst)
        if math.isfinite(worst):
            self.samples.append(worst)
        for (recipe, gemm), value in m.sqnr.items():
            self.gemms.setdefault(f"{recipe}/{gemm.value}/sqnr_db", RunningStats()).add(value)
            self.gemms.setdefault(f"{recipe}/{gemm.value}/rel_error", RunningStats()).add(m.rel_error[(recipe, gemm)])
        for kind, values in (("saturated", m.saturated), ("flushed", m.flushed)):
            for operand, share in values.items():
                self.casts[f"{kind}/{operand}"] = self.casts.get(f"{kind}/{operand}", 0.0) + share
        for operand, value in m.amax.items():
            self.amax[operand] = max(self.amax[operand], value)
        self.kernel = m.kernel

    def observe_rows(self, rows: int) -> None:
        self.rows += rows
        self.passes += 1

    # ---------------------------------------------------------------- the flat vector ranks exchange
    def to_vector(self) -> list[float]:
        out = list(self.verdict.to_list())
        for key in _gemm_keys():
            out += self.gemms.get(key, RunningStats()).to_list()
        out += [self.casts.get(key, 0.0) for key in _cast_keys()]
        out += [self.amax[o] for o in OPERANDS] + [self.rows, self.passes]
        return out

    @classmethod
    def from_vectors(cls, fqn: str, in_features: int, out_features: int, vectors: list[list[float]],
                     kernel: str = "") -> LayerRecord:
        """Combine ranks: sums add, amaxes take the maximum."""
        record = cls(fqn, in_features, out_features, kernel=kernel)
        for vector in vectors:
            values = iter(vector)
            record.verdict = record.verdict.merge(RunningStats.from_list([next(values) for _ in range(3)]))
            for key in _gemm_keys():
                stats = RunningStats.from_list([next(values) for _ in range(3)])
                record.gemms[key] = record.gemms.get(key, RunningStats()).merge(stats)
            for key in _cast_keys():
                record.casts[key] = record.casts.get(key, 0.0) + next(values)
            for operand in OPERANDS:
                record.amax[operand] = max(record.amax[operand], next(values))
            record.rows += next(values)
            record.passes += next(values)
        return record

    # ---------------------------------------------------------------- what the report says
    @property
    def mean_rows(self) -> float:
        return self.rows / self.passes if self.passes else 0.0

    def flops(self) -> float:
        return gemm_flops(self.mean_rows, self.in_features, self.out_features)

    def summary(self, threshold_db: float, confidence: float) -> dict[str, Any]:
        low, high = self.verdict.bounds(confidence)
        count = self.verdict.count
        gemms: dict[str, dict[str, dict[str, float]]] = {}
        for key, stats in self.gemms.items():
            recipe, gemm, metric = key.split("/")
            gemms.setdefault(recipe, {}).setdefault(gemm, {})[metric] = _finite(stats.mean)
        return {
            "verdict": self.verdict.verdict(threshold_db, confidence),
            "sqnr_db_mean": _finite(self.verdict.mean), "sqnr_db_low": _finite(low), "sqnr_db_high": _finite(high),
            "samples": int(count),
            "shape": {"M": round(self.mean_rows), "K": self.in_features, "N": self.out_features},
            "gemms": gemms,
            "amax": dict(self.amax),
            "saturated_share": {o: self.casts.get(f"saturated/{o}", 0.0) / count if count else None for o in OPERANDS},
            "flushed_share": {o: self.casts.get(f"flushed/{o}", 0.0) / count if count else None for o in OPERANDS},
            "kernel": self.kernel or None,
        }


def _gemm_keys() -> list[str]:
    return [f"{recipe}/{gemm.value}/{metric}" for recipe in RECIPES for gemm in Gemm for metric in ("sqnr_db", "rel_error")]


def _cast_keys() -> list[str]:
    return [f"{kind}/{operand}" for kind in ("saturated", "flushed") for operand in OPERANDS]


def _finite(value: float) -> float | None:
    """JSON has no inf or nan: an unbounded or undefined figure is ``None``."""
    return value if math.isfinite(value) else None


def combine(records: dict[str, LayerRecord], gathered: torch.Tensor) -> dict[str, LayerRecord]:
    """``gathered``: [ranks, layers, fields] (every rank's :meth:`LayerRecord.to_vector`, layers in ``records``' order)."""
    combined = {}
    for i, (fqn, record) in enumerate(records.items()):
        vectors = [gathered[r, i].tolist() for r in range(gathered.shape[0])]
        combined[fqn] = LayerRecord.from_vectors(fqn, record.in_features, record.out_features, vectors, record.kernel)
    return combined
