"""FP8Probe: which Linear layers can run in FP8, learned from the job's own activations and gradients."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from torch import nn
from typing_extensions import override

from lightning_ett.callbacks.loop_state import accumulating
from lightning_ett.durable.errors import ConfigurationError
from lightning_ett.durable.files import atomic_write_text
from lightning_ett.fp8.cast import RECIPES
from lightning_ett.fp8.eligible import eligible
from lightning_ett.fp8.probe import LayerRecord, combine, measure
from lightning_ett.fp8.stats import SAFE, UNDECIDED
from lightning_ett.instrument.environment import ENV_RUN_DIR
from lightning_ett.instrument.timeline import FP8_FACT, get_timeline

RESULTS_FILE = "fp8_probe.json"
DEFAULT_SQNR_THRESHOLD_DB = 20.0


class FP8Probe(Callback):
    r"""Measure, at sampled training steps, what FP8 would do to each ``nn.Linear``'s three GEMMs; decide which are safe.

    At a sampled step every selected layer that is still undecided keeps its real input and, in
    backward, the gradient of its output; its forward GEMM and both backward GEMMs are then
    computed in the layer's own precision and in FP8 as torchao's ``tensorwise`` and ``rowwise``
    recipes cast them (``torch._scaled_mm`` where the backend has it, on CPU too in torch 2.13,
    else an exact dequantize-and-matmul emulation: :mod:`lightning_ett.fp8.cast`). Per layer
    it keeps, across samples, the SQNR (torchao's definition) and relative error of each GEMM,
    the amaxes of input, weight and gradient, the shares of values saturated and flushed to
    zero, and the GEMM shape with its share of the model's Linear FLOPs.

    The verdict uses one number per sample: the worst SQNR of the layer's three GEMMs under
    ``recipe``. Its mean's two-sided Student-t interval at ``confidence`` makes the layer
    ``safe`` (lower bound >= ``sqnr_threshold_db``), ``unsafe`` (upper bound below it) or
    ``undecided``; decided layers are no longer sampled. Sampling is every ``every_n_steps``
    steps at most, and rarer when needed to keep the probe's own time — measured, hooks and
    GEMMs — within ``max_overhead`` of the training time. ``eligible`` is torchao's verdict on
    the shape (:mod:`lightning_ett.fp8.eligible`).

    Every rank samples its own data; at the end of ``fit`` one all-gather combines the ranks'
    statistics (sums) and every rank holds the same :attr:`results`. Then rank zero prints a
    table ending with "FP8-safe and eligible: X of Y layers, Z% of GEMM FLOPs", writes
    ``fp8_probe.json`` into the ETT run directory (``LIGHTNING_ETT_RUN_DIR``, which ETTMonitor
    and ``lightning run`` set; else ``trainer.default_root_dir``), logs a table to every
    ``WandbLogger`` and states the line in the ETT report. :meth:`module_filter_fn` is ready for
    torchao's ``convert_to_float8_training``. Only ``nn.Linear`` layers are probed: TorchRec's
    (sharded) embedding tables are lookups, not GEMMs, and are left alone.

    Args:
        every_n_steps: at most one sample every this many optimizer steps (the first at this step).
        sqnr_threshold_db: the SQNR a layer's worst GEMM must reach (default 20 dB: an RMS
            error of 10 % of the GEMM's output; e5m2 gradients alone give ~25 dB on well-scaled data).
        confidence: of the interval that decides (0 < confidence < 1).
        max_overhead: the probe's time as a share of training time to stay within (0 < x < 1).
        include: fqn patterns (``fnmatch``: ``"model.over_arch.*"``) of the layers to probe; ``None``: all.
        exclude: fqn patterns of layers not to probe.
        recipe: the torchao recipe the verdict and eligibility are for (``"tensorwise"`` or ``"rowwise"``).
        max_rows: rows of each GEMM's M dimension (batch x sequence) measured per sample, chosen at
            random (the scales still come from every row); ``None``: all. Bounds a sample's cost.

    Under ``torch.compile``, the hooks of a sampled step make Dynamo recompile the hooked
    layers' frames; probe an eager run where that matters.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        sqnr_threshold_db: float = DEFAULT_SQNR_THRESHOLD_DB,
        confidence: float = 0.95,
        max_overhead: float = 0.02,
        include: list[str] | str | None = None,
        exclude: list[str] | str | None = None,
        recipe: str = "tensorwise",
        max_rows: int | None = 512,
    ) -> None:
        _validate(every_n_steps, sqnr_threshold_db, confidence, max_overhead, recipe)
        if max_rows is not None and (not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 16):
            raise ConfigurationError(f"FP8Probe(max_rows={max_rows!r}): expected an int >= 16 (rows of a GEMM measured per "
                                     "sample), or None for all rows.")
        self.max_rows = max_rows
        self.every_n_steps = every_n_steps
        self.sqnr_threshold_db = float(sqnr_threshold_db)
        self.confidence = float(confidence)
        self.max_overhead = float(max_overhead)
        self.include = _patterns(include, "include")
        self.exclude = _patterns(exclude, "exclude")
        self.recipe = recipe
        self.results: dict[str, dict[str, Any]] = {}
        # per fit
        self._layers: dict[str, nn.Linear] = {}  # every Linear of the module, by fqn
        self._selected: list[str] = []
        self._records: dict[str, LayerRecord] = {}
        self._handles: list[Any] = []
        self._generator = torch.Generator()
        self._sampling = False
        self._batch_start = 0.0
        self._probe_step_s = 0.0
        # resumable
        self.next_sample_step = every_n_steps
        self.probe_s = 0.0
        self.train_s = 0.0
        self.train_steps = 0
        self.samples_taken = 0
        self.sampled_steps: list[int] = []  # the global steps this rank sampled at (this fit)
        self._restored: dict[str, Any] | None = None
        self._overheads: list[float] = []  # each rank's measured overhead, known at the end of fit

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._layers = {fqn: m for fqn, m in pl_module.named_modules() if isinstance(m, nn.Linear)}
        self._selected = self._select(pl_module)
        self._records = {fqn: LayerRecord(fqn, m.in_features, m.out_features) for fqn, m in self._layers.items()}
        self._generator = torch.Generator().manual_seed(trainer.global_rank)  # which rows a sample measures

    def _select(self, pl_module: pl.LightningModule) -> list[str]:
        names = list(self._layers)
        listing = f"its nn.Linear layers are: {names}" if names else "it has no nn.Linear layer"
        for pattern in self.include or []:
            if not any(_matches(fqn, pattern) for fqn in names):
                raise ConfigurationError(f"FP8Probe(include=[..., {pattern!r}, ...]): the pattern matches no nn.Linear layer of "
                                         f"{type(pl_module).__name__}; {listing}. Patterns are fnmatch patterns of module names.")
        for pattern in self.exclude or []:
            if not any(_matches(fqn, pattern) for fqn in names):
                warnings.warn(f"FP8Probe(exclude=[..., {pattern!r}, ...]) matches no nn.Linear layer; {listing}.",
                              stacklevel=2)
        selected = [fqn for fqn in names if (self.include is None or any(_matches(fqn, p) for p in self.include))
                    and not any(_matches(fqn, p) for p in self.exclude or [])]
        if not selected:
            raise ConfigurationError(f"FP8Probe(include={self.include!r}, exclude={self.exclude!r}) selects no layer to probe "
                                     f"in {type(pl_module).__name__}; {listing}.")
        return selected

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restored, self._restored = self._restored, None
        if restored and trainer.global_rank == 0:  # every rank loaded rank 0's sums: one copy of them counts
            kernels = restored.get("kernels", {})
            for fqn, vector in restored.get("records", {}).items():
                if fqn in self._records:
                    record = self._records[fqn]
                    self._records[fqn] = LayerRecord.from_vectors(fqn, record.in_features, record.out_features, [vector],
                                                                  kernels.get(fqn, ""))

    # ------------------------------------------------------------------ sampling
    def _undecided(self) -> list[str]:
        return [f for f in self._selected
                if self._records[f].verdict.verdict(self.sqnr_threshold_db, self.confidence) == UNDECIDED]

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()
        self._probe_step_s = 0.0
        if trainer.global_step < self.next_sample_step or self._sampling or accumulating(trainer):
            return  # (the common case first: this is every step's cost; one batch per optimizer step is sampled)
        undecided = set(self._undecided())
        if not undecided:
            return
        start = time.perf_counter()
        self._sampling = True
        for fqn, module in self._layers.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(fqn, probe=fqn in undecided)))
        self._probe_step_s += time.perf_counter() - start

    def _forward_hook(self, fqn: str, probe: bool) -> Callable[..., None]:
        record = self._records[fqn]

        def hook(module: nn.Linear, args: tuple[Any, ...], output: torch.Tensor) -> None:
            start = time.perf_counter()
            rows = args[0].detach().reshape(-1, module.in_features)
            record.observe_rows(rows.shape[0])
            if probe and torch.is_grad_enabled() and output.requires_grad:
                weight = module.weight.detach()

                def on_grad(grad: torch.Tensor) -> None:
                    began = time.perf_counter()
                    grad_rows = grad.detach().reshape(-1, module.out_features)
                    record.add(measure(rows, weight, grad_rows, self.recipe, self.max_rows, self._generator), self.recipe)
                    self._probe_step_s += time.perf_counter() - began

                output.register_hook(on_grad)
            self._probe_step_s += time.perf_counter() - start

        return hook

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        self.train_steps += 1
        if not self._sampling:
            self.train_s += now - self._batch_start
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._sampling = False
        self._probe_step_s += time.perf_counter() - now
        self.probe_s += self._probe_step_s
        self.train_s += max(time.perf_counter() - self._batch_start - self._probe_step_s, 0.0)
        self.samples_taken += 1
        self.sampled_steps.append(trainer.global_step - 1)  # (the step that just ran)
        self.next_sample_step = trainer.global_step + self._interval(self._probe_step_s)

    def _interval(self, sample_cost_s: float) -> int:
        """Steps to the next sample: at least ``every_n_steps``; enough that this sample's cost is ``max_overhead``
        of the training between, and that the running total returns within budget."""
        step_s = self.train_s / max(self.train_steps, 1)
        if step_s <= 0:
            return self.every_n_steps
        for_this = sample_cost_s / (self.max_overhead * step_s)
        to_catch_up = (self.probe_s / self.max_overhead - self.train_s) / step_s
        return max(self.every_n_steps, math.ceil(for_this), math.ceil(to_catch_up))

    @property
    def overhead(self) -> float:
        """The probe's measured time as a share of training time on this rank, so far."""
        return self.probe_s / self.train_s if self.train_s else 0.0

    # ------------------------------------------------------------------ the verdict
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._records:
            return
        vectors = [record.to_vector() for record in self._records.values()]
        timing = [self.probe_s, self.train_s, float(self.samples_taken)]
        local = torch.tensor(vectors + [timing + [0.0] * (len(vectors[0]) - len(timing))], dtype=torch.float64)
        gathered = trainer.strategy.all_gather(local.to(trainer.strategy.root_device)).cpu()  # the one collective
        if gathered.dim() == 2:  # a single process
            gathered = gathered.unsqueeze(0)
        combined = combine(self._records, gathered[:, :-1])
        per_rank = gathered[:, -1, :len(timing)]
        self.results = self._results(combined)
        self._overheads = [float(p[0] / p[1]) if p[1] else 0.0 for p in per_rank]
        if trainer.is_global_zero:
            self._publish(trainer, combined)

    def _results(self, combined: dict[str, LayerRecord]) -> dict[str, dict[str, Any]]:
        total_flops = sum(r.flops() for r in combined.values()) or 1.0
        results = {}
        for fqn in self._selected:
            record = combined[fqn]
            summary = record.summary(self.sqnr_threshold_db, self.confidence)
            summary["eligible"] = eligible(self._layers[fqn], fqn, self.recipe)
            summary["flop_share"] = record.flops() / total_flops
            summary["relative_error"] = max((g.get("rel_error") or 0.0) for g in summary["gemms"][self.recipe].values()) \
                if summary["samples"] else None
            results[fqn] = summary
        return results

    def summary_line(self) -> str:
        chosen = [r for r in self.results.values() if r["verdict"] == SAFE and r["eligible"]]
        share = 100 * sum(r["flop_share"] for r in chosen)
        return f"FP8-safe and eligible: {len(chosen)} of {len(self.results)} layers, {share:.1f}% of GEMM FLOPs"

    def module_filter_fn(self, require_eligible: bool = True) -> Callable[[nn.Module, str], bool]:
        """``(module, fqn) -> bool`` for torchao's ``convert_to_float8_training``: the layers found safe (and eligible).

        Names are matched as this LightningModule names its modules, or by their tail when the
        filter is applied to a submodule (``lightning_module.model`` → ``"dense_arch..."``).
        """
        chosen = {f for f, r in self.results.items() if r["verdict"] == SAFE and (r["eligible"] or not require_eligible)}

        def module_filter(module: nn.Module, fqn: str) -> bool:
            return isinstance(module, nn.Linear) and any(name == fqn or name.endswith("." + fqn) for name in chosen)

        return module_filter

    # ------------------------------------------------------------------ where the results go (rank zero)
    def _publish(self, trainer: pl.Trainer, combined: dict[str, LayerRecord]) -> None:
        line = self.summary_line()
        self._print_table(line)
        payload = {"recipe": self.recipe, "sqnr_threshold_db": self.sqnr_threshold_db, "confidence": self.confidence,
                   "max_overhead": self.max_overhead, "overhead_per_rank": self._overheads,
                   "samples_taken": self.samples_taken, "summary": line, "layers": self.results}
        path = _run_dir(trainer) / RESULTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(payload, indent=2) + "\n")
        chosen = [r for r in self.results.values() if r["verdict"] == SAFE and r["eligible"]]
        get_timeline().fact(FP8_FACT, recipe=self.recipe, layers=len(self.results), safe_and_eligible=len(chosen),
                            flop_share=sum(r["flop_share"] for r in chosen),
                            unsafe=sum(r["verdict"] == "unsafe" for r in self.results.values()),
                            undecided=sum(r["verdict"] == UNDECIDED for r in self.results.values()))
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                columns, rows = self._table_rows()
                logger.log_table(key="fp8/probe", columns=columns, data=rows)
                logger.experiment.summary.update({"fp8/safe_and_eligible_layers": len(chosen), "fp8/layers": len(self.results),
                                                  "fp8/safe_and_eligible_flop_share": sum(r["flop_share"] for r in chosen)})

    def _table_rows(self) -> tuple[list[str], list[list[Any]]]:
        columns = ["layer", "verdict", "eligible", "sqnr_db_mean", "sqnr_db_low", "sqnr_db_high", "samples", "flop_share",
                   "M", "K", "N", "amax_input", "flushed_input"]
        rows = [[fqn, r["verdict"], r["eligible"], r["sqnr_db_mean"], r["sqnr_db_low"], r["sqnr_db_high"], r["samples"],
                 r["flop_share"], r["shape"]["M"], r["shape"]["K"], r["shape"]["N"], r["amax"]["input"],
                 r["flushed_share"]["input"]] for fqn, r in self.results.items()]
        return columns, rows

    def _print_table(self, line: str) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"FP8Probe ({self.recipe}, threshold {self.sqnr_threshold_db:g} dB, {self.confidence:.0%} "
                      f"confidence)")
        table.add_column("layer", overflow="fold")
        for column in ("verdict", "eligible", "SQNR dB [interval]", "samples", "FLOPs", "M×K×N", "flushed in"):
            table.add_column(column, no_wrap=True)
        style = {"safe": "green", "unsafe": "red", UNDECIDED: "yellow"}
        for fqn, r in self.results.items():
            interval = (f"{r['sqnr_db_mean']:.1f} [{_num(r['sqnr_db_low'])}, {_num(r['sqnr_db_high'])}]"
                        if r["sqnr_db_mean"] is not None else "—")
            flushed = r["flushed_share"]["input"]
            table.add_row(fqn, f"[{style[r['verdict']]}]{r['verdict']}[/]", "yes" if r["eligible"] else "no", interval,
                          str(r["samples"]), f"{100 * r['flop_share']:.1f}%",
                          f"{r['shape']['M']}×{r['shape']['K']}×{r['shape']['N']}",
                          f"{100 * flushed:.1f}%" if flushed is not None else "—")
        console = Console()
        console.print(table)
        console.print(line)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"records": {f: r.to_vector() for f, r in self._records.items()},
                "kernels": {f: r.kernel for f, r in self._records.items()}, "next_sample_step": self.next_sample_step,
                "probe_s": self.probe_s, "train_s": self.train_s, "train_steps": self.train_steps,
                "samples_taken": self.samples_taken}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next_sample_step = int(state_dict.get("next_sample_step", self.every_n_steps))
        self.probe_s = float(state_dict.get("probe_s", 0.0))
        self.train_s = float(state_dict.get("train_s", 0.0))
        self.train_steps = int(state_dict.get("train_steps", 0))
        self.samples_taken = int(state_dict.get("samples_taken", 0))
        self._restored = state_dict  # the sums: applied on rank 0 only, at train start


def _validate(every_n_steps: Any, threshold: Any, confidence: Any, max_overhead: Any, recipe: Any) -> None:
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
        raise ConfigurationError(f"FP8Probe(every_n_steps={every_n_steps!r}): expected an int >= 1.")
    if not number(threshold) or not 0 < threshold < 100:
        raise ConfigurationError(f"FP8Probe(sqnr_threshold_db={threshold!r}): expected a number of dB in (0, 100), e.g. "
                                 f"{DEFAULT_SQNR_THRESHOLD_DB:g} (an RMS error of 10% of the GEMM's output).")
    if not number(confidence) or not 0 < confidence < 1:
        raise ConfigurationError(
            f"FP8Probe(confidence={confidence!r}): expected a probability strictly between 0 and 1, e.g. 0.95.")
    if not number(max_overhead) or not 0 < max_overhead < 1:
        raise ConfigurationError(f"FP8Probe(max_overhead={max_overhead!r}): expected a share of training time in (0, 1), "
                                 "e.g. 0.02.")
    if recipe not in RECIPES:
        raise ConfigurationError(f"FP8Probe(recipe={recipe!r}): expected one of {list(RECIPES)} (torchao's float8 recipes).")


def _patterns(value: Any, name: str) -> list[str] | None:
    if value is None:
        return None
    patterns = [value] if isinstance(value, str) else value
    if not isinstance(patterns, (list, tuple)) or not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ConfigurationError(f"FP8Probe({name}={value!r}): expected a non-empty list of fqn patterns (fnmatch), or None.")
    return list(patterns)


def _matches(fqn: str, pattern: str) -> bool:
    return fqn == pattern or fnmatch.fnmatchcase(fqn, pattern)


def _num(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "—"


def _run_dir(trainer: pl.Trainer) -> Path:
    bound = get_timeline().run_dir
    if bound is not None:
        return Path(bound)
    env = os.environ.get(ENV_RUN_DIR)
    return Path(env) if env else Path(trainer.default_root_dir)
