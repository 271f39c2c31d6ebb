"""What one sampled step says about a Linear layer in FP8, and a layer's record of its windows.

A sampled step measures the GEMMs the layer really runs: the output GEMM in its forward (so a
frozen layer, whose backward hook never fires, is measured too), and in backward the
grad-input GEMM when its input needs a gradient and the grad-weight GEMM when its weight
does. Each is computed as the layer computes it today — in autocast's dtype under mixed
precision, in the parameters' dtype otherwise (:func:`compute_dtype`) — and in FP8 as
torchao's ``Float8Linear`` computes it on a GPU under the same precision (the input cast to
autocast's dtype first, the weight cast to FP8 from its own dtype, the product returned in the
input's dtype; :mod:`lightning_ett.fp8.cast`), and compared by SQNR.

Memory is bounded by ``max_rows``: the forward keeps that many sampled rows of the input (in
the compute dtype) and the amaxes the real casts take over every row, not the activation.

:class:`LayerRecord` keeps, per layer on this rank, the worst SQNR of each sampled window (the
verdict's observations: :mod:`lightning_ett.fp8.stats`) and the report's sums, as one flat
vector, so that every rank's records combine with one all-gather at the end of fit
(:func:`combine`). No Lightning here: the callback (:class:`lightning_ett.callbacks.FP8Probe`)
decides when to sample and where results go.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lightning_ett.fp8.cast import Gemm, Recipe, amax, cast, matmul, relative_error, sqnr_db
from lightning_ett.fp8.eligible import gemm_flops
from lightning_ett.fp8.stats import Decision, RunningStats, decide

OPERANDS = ("input", "weight", "grad_output")
KERNELS = ("scaled_mm", "emulated")
MAX_WINDOWS = 1024  # per layer and rank: the windows kept one by one (the first half always, then the latest)


def compute_dtype(x: torch.Tensor, output: torch.Tensor) -> torch.dtype:
    """The dtype a Linear's GEMM ran in: autocast's where it is on for the input's device, else the output's."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return output.dtype


@dataclass(frozen=True)
class GemmResult:
    gemm: Gemm
    sqnr: float
    kernel: str
    saturated: dict[str, float]  # per operand it casts (the verdict recipe's losses)
    flushed: dict[str, float]


@dataclass(frozen=True)
class ForwardSample:
    """What a sampled forward keeps for the backward GEMMs: sampled input rows and the whole input's amaxes."""

    dtype: torch.dtype
    rows: torch.Tensor | None  # the sampled row indices (None: every row)
    x: torch.Tensor  # [m, K] in ``dtype``
    x_amax: torch.Tensor | None  # the whole input's amax for the output GEMM's cast (None: per-row, from ``x``)
    x_amax_grad_weight: torch.Tensor  # ... for the grad-weight GEMM's cast (reduced along M: every row counts)
    weight: torch.Tensor  # [N, K] the parameter itself (no copy): torchao casts it to FP8 from its own dtype

    @property
    def weight_reference(self) -> torch.Tensor:
        """[N, K] in ``dtype``: what the layer's GEMM reads today (autocast's copy), made when needed, not kept."""
        return self.weight.to(self.dtype)


@torch.no_grad()
def sample_forward(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, recipe: Recipe, max_rows: int | None,
                   generator: torch.Generator) -> ForwardSample:
    """``x``: the layer's input as [M, K] rows; ``max_rows`` of them are kept, chosen at random."""
    m = x.shape[0]
    rows = None
    if max_rows and m > max_rows:
        rows = torch.randperm(m, generator=generator)[:max_rows].sort().values.to(x.device)  # (a CPU generator)
    x_left = recipe.operands[Gemm.OUTPUT][0]
    x_right = recipe.operands[Gemm.GRAD_WEIGHT][1]
    kept = (x if rows is None else x.index_select(0, rows)).to(dtype)
    return ForwardSample(dtype, rows, kept, None if x_left.axiswise else amax(x, x_left, -1, dtype),
                         amax(x, x_right, 0, dtype), weight)


def _measure(gemm: Gemm, recipe: Recipe, a: torch.Tensor, b: torch.Tensor, a_amax: torch.Tensor | None,
             b_amax: torch.Tensor | None, dtype: torch.dtype, names: tuple[str | None, str | None],
             b_reference: torch.Tensor) -> GemmResult:
    """``a @ b`` in FP8 against ``a @ b_reference`` (``b`` as the GEMM reads it today, in ``dtype``)."""
    left, right = recipe.operands[gemm]
    reference = a @ b_reference
    ca = cast(a, left, -1, a_amax, losses=names[0] is not None)
    cb = cast(b, right, 0, b_amax, losses=names[1] is not None)
    approx, kernel = matmul(ca, cb, dtype, recipe.fast_accum[gemm])
    saturated = {n: c.saturated for n, c in zip(names, (ca, cb)) if n is not None and c.saturated is not None}
    flushed = {n: c.flushed for n, c in zip(names, (ca, cb)) if n is not None and c.flushed is not None}
    return GemmResult(gemm, sqnr_db(reference, approx), kernel, saturated, flushed)


@torch.no_grad()
def measure_output(sample: ForwardSample, recipe: Recipe) -> GemmResult:
    """The forward GEMM ``x @ Wᵀ`` of the sampled rows, in the compute dtype and in FP8."""
    with torch.autocast(sample.x.device.type, enabled=False):  # (forward hooks run inside the autocast region)
        return _measure(Gemm.OUTPUT, recipe, sample.x, sample.weight.t(), sample.x_amax, None, sample.dtype,
                        ("input", "weight"), sample.weight_reference.t())


@torch.no_grad()
def measure_backward(sample: ForwardSample, grad_out: torch.Tensor, recipe: Recipe, grad_input: bool,
                     grad_weight: bool) -> list[GemmResult]:
    """``grad_out``: [M, N], the gradient of the layer's output; the backward GEMMs the layer runs, on the sampled rows."""
    dy_full = grad_out.to(sample.dtype) if grad_out.dtype != sample.dtype else grad_out
    dy = dy_full if sample.rows is None else dy_full.index_select(0, sample.rows)
    results = []
    with torch.autocast(dy.device.type, enabled=False):
        if grad_input:  # dy @ W: dy per row (reduced along N) or per tensor
            left = recipe.operands[Gemm.GRAD_INPUT][0]
            results.append(_measure(Gemm.GRAD_INPUT, recipe, dy, sample.weight, None if left.axiswise else
                                    amax(dy_full, left, -1), None, sample.dtype, ("grad_output", None),
                                    sample.weight_reference))
        if grad_weight:  # dyᵀ @ x, reduced along M: both scales from every row
            left = recipe.operands[Gemm.GRAD_WEIGHT][0]
            dy_amax = amax(dy_full, left, 0)
            results.append(_measure(Gemm.GRAD_WEIGHT, recipe, dy.t(), sample.x, dy_amax.t() if left.axiswise else dy_amax,
                                    sample.x_amax_grad_weight, sample.dtype, (None, None), sample.x))
    return results


# ---------------------------------------------------------------------------------------------- per-layer record
@dataclass
class LayerRecord:
    """One layer's observations on this rank: the worst SQNR per window, and the report's sums, as one flat vector."""

    fqn: str
    in_features: int
    out_features: int
    threshold_db: float
    windows: dict[int, float] = field(default_factory=dict)  # window -> worst SQNR (dB) measured in it
    dropped: float = 0.0  # windows past MAX_WINDOWS no longer kept (the oldest after the first half), counted
    dropped_bad: float = 0.0  # ... of them below the threshold
    gemms: dict[str, RunningStats] = field(default_factory=dict)  # "<gemm>/<sqnr_db|rel_error>"
    kernels: dict[str, set[str]] = field(default_factory=dict)  # gemm -> the kernels that computed it
    casts: dict[str, RunningStats] = field(default_factory=dict)  # "<saturated|flushed>/<operand>"
    amax: dict[str, float] = field(default_factory=lambda: dict.fromkeys(OPERANDS, 0.0))
    rows: float = 0.0  # input rows seen, summed over forward passes observed (for the GEMM shape and FLOPs)
    passes: float = 0.0  # calls observed
    steps: float = 0.0  # sampled steps observed, whether the layer ran in them or not (FLOPs are per step)
    worst: dict[str, float] = field(default_factory=lambda: {g.value: math.inf for g in Gemm})  # per GEMM, dB

    def observe_rows(self, rows: int) -> None:
        self.rows += rows
        self.passes += 1

    def observe_step(self) -> None:
        self.steps += 1

    def observe_amax(self, operand: str, tensor: torch.Tensor) -> None:
        low, high = torch.aminmax(tensor.detach())
        self.amax[operand] = max(self.amax[operand], float(max(-low, high)))

    def add(self, window: int, result: GemmResult) -> None:
        """One measured GEMM of the sample in ``window``: the window's observation is its worst GEMM."""
        self._observe(window, result.sqnr)
        value = -math.inf if math.isnan(result.sqnr) else result.sqnr
        self.worst[result.gemm.value] = min(self.worst[result.gemm.value], value)
        for metric, value in (("sqnr_db", result.sqnr), ("rel_error", relative_error(result.sqnr))):
            self.gemms.setdefault(f"{result.gemm.value}/{metric}", RunningStats()).add(value)
        self.kernels.setdefault(result.gemm.value, set()).add(result.kernel)
        for kind, values in (("saturated", result.saturated), ("flushed", result.flushed)):
            for operand, share in values.items():
                self.casts.setdefault(f"{kind}/{operand}", RunningStats()).add(share)

    def _observe(self, window: int, value: float) -> None:
        _merge_into(self.windows, [(window, value)])
        if len(self.windows) > MAX_WINDOWS:
            self._cap()

    def _cap(self) -> None:
        """At most ``MAX_WINDOWS`` kept: the first half (the test's own windows) and the latest (re-checks); the
        ones between are counted (and their bad ones), as the verdict still counts them."""
        if len(self.windows) <= MAX_WINDOWS:
            return
        order = sorted(self.windows)
        for window in order[MAX_WINDOWS // 2:len(order) - (MAX_WINDOWS - MAX_WINDOWS // 2)]:
            self.dropped += 1
            self.dropped_bad += not self.windows.pop(window) >= self.threshold_db

    def renumber_windows(self, old_every: int, new_every: int) -> None:
        """Windows counted in ``old_every``-step units (a checkpoint's), renumbered in ``new_every``-step ones by their
        first step; two that fall into one window are one observation, at its worst."""
        if old_every == new_every:
            return
        windows: dict[int, float] = {}
        _merge_into(windows, ((window * old_every // new_every, value) for window, value in self.windows.items()))
        self.windows = windows

    def decision(self, tail: float, confidence: float, prior: LayerRecord | None = None) -> Decision:
        """The verdict on this record's windows, and on ``prior``'s before them (a rank that resumed with the job's
        windows of the last checkpoint, kept apart so that only one rank reports them)."""
        record = self
        if prior is not None:  # (its windows are before this record's: their drops add up)
            record = LayerRecord(self.fqn, self.in_features, self.out_features, self.threshold_db, dict(prior.windows),
                                 self.dropped + prior.dropped, self.dropped_bad + prior.dropped_bad)
            _merge_into(record.windows, self.windows.items())
            record._cap()
        windows, dropped, dropped_bad = record.windows, record.dropped, record.dropped_bad
        found = decide(sorted(windows.items()), self.threshold_db, tail, confidence)
        if dropped:
            found = replace(found, windows=found.windows + int(dropped), bad_windows=found.bad_windows + int(dropped_bad))
        return found

    # ---------------------------------------------------------------- the flat vector ranks exchange
    def to_vector(self) -> list[float]:
        out: list[float] = []
        for key in _gemm_keys():
            out += self.gemms.get(key, RunningStats()).to_list()
        for gemm in Gemm:
            out.append(float(sum(1 << i for i, k in enumerate(KERNELS) if k in self.kernels.get(gemm.value, ()))))
        for key in _cast_keys():
            out += self.casts.get(key, RunningStats()).to_list()
        out += [self.amax[o] for o in OPERANDS] + [self.rows, self.passes, self.steps, self.dropped, self.dropped_bad]
        out += [self.worst[g.value] for g in Gemm]
        pairs = sorted(self.windows.items())
        for i in range(MAX_WINDOWS):
            out += [float(pairs[i][0]), pairs[i][1]] if i < len(pairs) else [math.nan, math.nan]
        return out

    @classmethod
    def from_vectors(cls, fqn: str, in_features: int, out_features: int, threshold_db: float,
                     vectors: list[list[float]]) -> LayerRecord:
        """Combine ranks: sums add, amaxes take the maximum, a window seen on several ranks is one, at its worst."""
        record = cls(fqn, in_features, out_features, threshold_db)
        for vector in vectors:
            values = iter(vector)
            for key in _gemm_keys():
                stats = RunningStats.from_list([next(values) for _ in range(3)])
                record.gemms[key] = record.gemms.get(key, RunningStats()).merge(stats)
            for gemm in Gemm:
                mask = int(next(values))
                kernels = {k for i, k in enumerate(KERNELS) if mask & (1 << i)}
                if kernels:
                    record.kernels.setdefault(gemm.value, set()).update(kernels)
            for key in _cast_keys():
                stats = RunningStats.from_list([next(values) for _ in range(3)])
                record.casts[key] = record.casts.get(key, RunningStats()).merge(stats)
            for operand in OPERANDS:
                record.amax[operand] = max(record.amax[operand], next(values))
            record.rows += next(values)
            record.passes += next(values)
            record.steps = max(record.steps, next(values))  # (the ranks sample alike often: per-step FLOPs)
            # (the ranks drop alike: their windows are mostly the same ones; a sum would count one drop per rank)
            record.dropped = max(record.dropped, next(values))
            record.dropped_bad = max(record.dropped_bad, next(values))
            for gemm in Gemm:
                record.worst[gemm.value] = min(record.worst[gemm.value], next(values))
            pairs = [(next(values), next(values)) for _ in range(MAX_WINDOWS)]
            _merge_into(record.windows, ((int(w), v) for w, v in pairs if not math.isnan(w)))
        record._cap()  # once, after every rank's windows are in (not a sort per window)
        return record

    # ---------------------------------------------------------------- what the report says
    @property
    def mean_rows(self) -> float:
        """Rows per call (the GEMM's M)."""
        return self.rows / self.passes if self.passes else 0.0

    def flops(self) -> float:
        """Per training step: a layer called twice a step counts twice, one that runs one step in seven a seventh."""
        rows_per_step = self.rows / self.steps if self.steps else self.mean_rows
        return gemm_flops(rows_per_step, self.in_features, self.out_features)

    def measured(self) -> list[str]:
        """The GEMMs measured at least once (a frozen layer's forward only; no grad-input GEMM for a first layer)."""
        return [g.value for g in Gemm if self.gemms.get(f"{g.value}/sqnr_db", RunningStats()).count]

    def summary(self, tail: float, confidence: float) -> dict[str, Any]:
        found = self.decision(tail, confidence)
        gemms: dict[str, dict[str, Any]] = {}
        for key, stats in self.gemms.items():
            gemm, metric = key.split("/")
            gemms.setdefault(gemm, {})[f"{metric}_mean"] = _finite(stats.mean)
        for gemm, kernels in self.kernels.items():
            gemms.setdefault(gemm, {})["kernel"] = "+".join(sorted(kernels))

        def share(kind: str, operand: str) -> float | None:
            stats = self.casts.get(f"{kind}/{operand}")
            return stats.mean if stats and stats.count else None

        return {
            "verdict": found.verdict,
            "samples": found.windows, "samples_needed": found.needed, "autocorrelation": round(found.rho, 3),
            "safe_at_window": found.safe_at, "unsafe_at_window": found.unsafe_at, "bad_windows": found.bad_windows,
            "deciding_sqnr_db": _finite(found.bad_db),
            "sqnr_db_worst": _finite(found.worst_db), f"sqnr_db_q{round(100 * tail)}": _finite(found.quantile_db),
            "sqnr_db_worst_per_gemm": {g: _finite(v) for g, v in self.worst.items() if g in self.measured()},
            "measured_gemms": self.measured(),
            "shape": {"M": round(self.mean_rows), "K": self.in_features, "N": self.out_features},
            "gemms": gemms,
            "amax": dict(self.amax),
            "saturated_share": {o: share("saturated", o) for o in OPERANDS},
            "flushed_share": {o: share("flushed", o) for o in OPERANDS},
        }


def _gemm_keys() -> list[str]:
    return [f"{gemm.value}/{metric}" for gemm in Gemm for metric in ("sqnr_db", "rel_error")]


def _cast_keys() -> list[str]:
    return [f"{kind}/{operand}" for kind in ("saturated", "flushed") for operand in OPERANDS]


def _finite(value: float | None) -> float | None:
    """JSON has no inf or nan: an unbounded or undefined figure is ``None``."""
    return value if value is not None and math.isfinite(value) else None


def _merge_into(windows: dict[int, float], observations: Iterable[tuple[int, float]]) -> None:
    """Each (window, SQNR dB) into ``windows``: one window seen twice is one observation, at its worst. NaN (the FP8
    product overflowed) is the worst there is, -inf: ``min`` would otherwise keep or drop it by the order it came in."""
    for window, value in observations:
        value = -math.inf if math.isnan(value) else value
        windows[window] = min(windows.get(window, value), value)


def combine(records: dict[str, LayerRecord], gathered: torch.Tensor) -> dict[str, LayerRecord]:
    """``gathered``: [ranks, layers, fields] (every rank's :meth:`LayerRecord.to_vector`, layers in ``records``' order)."""
    combined = {}
    for i, (fqn, record) in enumerate(records.items()):
        vectors = [gathered[r, i].tolist() for r in range(gathered.shape[0])]
        combined[fqn] = LayerRecord.from_vectors(fqn, record.in_features, record.out_features, record.threshold_db,
                                                 vectors)
    return combined
