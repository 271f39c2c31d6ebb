"""FP8Probe: which Linear layers can run in FP8, learned from the job's own activations and gradients."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import statistics
import time
import warnings
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_ett.callbacks.collectives import all_gather
from lightning_ett.callbacks.loop_state import accumulating
from lightning_ett.durable.errors import ConfigurationError
from lightning_ett.durable.files import atomic_write_text
from lightning_ett.fp8.cast import RECIPES, Recipe
from lightning_ett.fp8.eligible import eligible
from lightning_ett.fp8.probe import LayerRecord, combine, compute_dtype, measure_backward, measure_output, sample_forward
from lightning_ett.fp8.stats import SAFE, UNDECIDED, UNSAFE, Decision
from lightning_ett.instrument.environment import ENV_RUN_DIR
from lightning_ett.instrument.timeline import FP8_FACT, get_timeline

RESULTS_FILE = "fp8_probe.json"
DEFAULT_SQNR_THRESHOLD_DB = 20.0


class FP8Probe(Callback):
    r"""Measure, at sampled training steps, what FP8 would do to each ``nn.Linear``'s GEMMs; decide which are safe.

    At a sampled step each selected layer still being tested (or due a re-check) keeps
    ``max_rows`` rows of its real input and, in backward, of the gradient of its output; each
    GEMM the layer really runs — the forward one always (a frozen layer too), grad-input when its
    input needs a gradient, grad-weight when its weight does — is computed as the layer computes
    it under the run's precision (autocast's dtype under ``bf16-mixed``/``16-mixed``, the
    parameters' under ``32-true``/``bf16-true``) and in FP8 as torchao's ``recipe`` casts it
    (:mod:`lightning_ett.fp8.cast`: torchao's scales and casts, ``torch._scaled_mm`` with
    torchao's ``use_fast_accum`` where the backend has it). Per layer it keeps the SQNR
    (torchao's definition) of each GEMM, the amaxes of input, weight and gradient, the shares of
    values saturated and flushed to zero, and the GEMM shape with its share of the Linear FLOPs.

    The verdict is a test on the tail of the per-step SQNR (worst measured GEMM, worst rank),
    one observation per window of ``every_n_steps`` steps (:mod:`lightning_ett.fp8.stats`, where
    the reasoning is): Wald's sequential test says ``safe`` when bad windows (below
    ``sqnr_threshold_db``) are rare — 36 clean windows at the defaults, ~19 more per bad one,
    more when windows are autocorrelated — and ``unsafe`` when they are a share ``tail`` or more
    (two close together at the start), naming the deciding step; ``undecided`` until then, with
    the reason (how many windows the budget has bought, and what would buy the rest). A safe
    layer is re-checked at one sampled window in ``recheck_every`` for the rest of training; a
    run of bad re-checks turns it ``unsafe``, with a warning, in the report and in W&B.
    Sampling is once per ``every_n_steps`` steps at most, and rarer when needed to keep the probe's
    own time within ``max_overhead`` of training time. ``eligible`` is torchao's verdict on the
    shape (:mod:`lightning_ett.fp8.eligible`).

    Every rank samples its own data; at the end of ``fit`` one all-gather combines the ranks'
    windows (one window seen on several ranks is one observation, at its worst) and every rank
    holds the same :attr:`results`. Then rank zero prints a table ending with "FP8-safe and
    eligible: X of Y layers, Z% of GEMM FLOPs", writes ``fp8_probe.json`` into the ETT run
    directory (``LIGHTNING_ETT_RUN_DIR``, which ETTMonitor and ``lightning run`` set; else
    ``trainer.default_root_dir``), logs a table to every ``WandbLogger`` and states the line in
    the ETT report. :meth:`module_filter_fn` is ready for torchao's ``convert_to_float8_training``.
    Layers are found at ``on_fit_start``, after ``configure_model``. Only ``nn.Linear`` layers
    are probed: TorchRec's (sharded) embedding tables are lookups, not GEMMs.

    Args:
        every_n_steps: the window: at most one sample every this many optimizer steps (the first at this step).
        sqnr_threshold_db: the SQNR a layer's worst GEMM must reach at a step (default 20 dB: an RMS
            error of 10 % of the GEMM's output; e5m2 gradients alone give ~25 dB on well-scaled data).
        tail: the share of steps allowed below the threshold (0 < tail < 1; 0.1: the 10th percentile of
            per-step SQNR must reach it).
        confidence: of the verdict ``safe`` (0 < confidence < 1).
        max_overhead: the probe's time as a share of training time to stay within (0 < x < 1).
        recheck_every: a safe layer is measured at one sampled window in this many.
        include: fqn patterns (``fnmatch``: ``"model.over_arch.*"``) of the layers to probe; ``None``: all.
        exclude: fqn patterns of layers not to probe.
        recipe: the torchao recipe the verdict and eligibility are for (``"tensorwise"`` or ``"rowwise"``).
        max_rows: rows of each GEMM's M dimension (batch x sequence) measured per sample, chosen at
            random (the scales still come from every row); ``None``: all. Bounds a sample's cost and memory.

    Under ``torch.compile``, hooks added after compilation do not run (Dynamo skips nn.Module
    hook guards), so a compiled module is not measured; the probe warns once when a sampled step
    ran none of its hooks. Probe an eager run. Lightning writes rank 0's callback state, so at
    each checkpoint the ranks' windows are combined (one all-gather in ``on_save_checkpoint``,
    which every rank runs) and a resumed run goes on from the whole job's windows — except a
    save in an exception's wake (``OnExceptionCheckpoint``), which may run on one rank only:
    it keeps rank 0's windows rather than wait in a collective. Sampled steps fall at random
    distances (0.5–1.5 intervals): a fixed stride would alias with periodic work. A second
    ``fit`` with the same callback measures that fit afresh; ``every_n_steps`` may change on a
    resume (the checkpoint's windows are renumbered by their first step).

    On CUDA the probe's timer starts after the device has finished the work already queued
    (the current stream's ``synchronize`` at a measured layer; the probe's own results sync it
    anyway), so the training step's kernels are not charged to the probe.
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        sqnr_threshold_db: float = DEFAULT_SQNR_THRESHOLD_DB,
        tail: float = 0.1,
        confidence: float = 0.95,
        max_overhead: float = 0.02,
        recheck_every: int = 4,
        include: list[str] | str | None = None,
        exclude: list[str] | str | None = None,
        recipe: str = "tensorwise",
        max_rows: int | None = 128,
    ) -> None:
        _validate(every_n_steps, sqnr_threshold_db, tail, confidence, max_overhead, recipe)
        if max_rows is not None and (not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 16):
            raise ConfigurationError(f"FP8Probe(max_rows={max_rows!r}): expected an int >= 16 (rows of a GEMM measured per "
                                     "sample), or None for all rows.")
        if not isinstance(recheck_every, int) or isinstance(recheck_every, bool) or recheck_every < 1:
            raise ConfigurationError(f"FP8Probe(recheck_every={recheck_every!r}): expected an int >= 1 (a safe layer is "
                                     "measured at one sampled window in this many).")
        self.max_rows = max_rows
        self.every_n_steps = every_n_steps
        self.sqnr_threshold_db = float(sqnr_threshold_db)
        self.tail = float(tail)
        self.confidence = float(confidence)
        self.max_overhead = float(max_overhead)
        self.recheck_every = recheck_every
        self.include = _patterns(include, "include")
        self.exclude = _patterns(exclude, "exclude")
        self.recipe = recipe
        self._recipe = Recipe.from_torchao(recipe)
        self.results: dict[str, dict[str, Any]] = {}
        # per fit
        self._layers: dict[str, nn.Linear] = {}  # every Linear of the module, by fqn
        self._selected: list[str] = []
        self._records: dict[str, LayerRecord] = {}
        self._local: dict[str, str] = {}  # this rank's verdict so far, per selected layer: what to sample
        self._handles: list[Any] = []
        self._generator = torch.Generator()
        self._sampling = False
        self._batch_start = 0.0
        self._probe_step_s = 0.0
        self._sample_costs: deque[float] = deque(maxlen=16)
        self._hooks_fired = 0
        self._warned_no_hooks = False
        self._last_global_step = 0
        self._schedule = torch.Generator()  # where in its window the next sample falls
        self._reset_fit()

    def _reset_fit(self) -> None:
        """What one ``fit`` measures (a second ``fit`` with the same callback starts over; a checkpoint's state, loaded
        after ``setup``, then carries a resumed one on)."""
        self.next_sample_step = self.every_n_steps
        self.opportunities = 0  # sampling windows reached
        self.probe_s = 0.0
        self.train_s = 0.0
        self.train_steps = 0
        self.samples_taken = 0
        self.sampled_steps: list[int] = []  # the global steps this rank sampled at (this fit)
        self.turned_unsafe: list[dict[str, Any]] = []  # safe layers a re-check found bad, on this rank (this fit)
        self._restored: dict[str, Any] | None = None
        self._prior: dict[str, LayerRecord] = {}  # ranks other than 0: the job's windows at the resumed checkpoint
        self._overheads: list[float] = []  # each rank's measured overhead, known at the end of fit
        self._sample_costs.clear()
        self._warned_no_hooks = False
        self._failed = False

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._reset_fit()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # (not ``setup``: Lightning calls ``configure_model`` after the callbacks' ``setup``)
        self._layers = {fqn: m for fqn, m in pl_module.named_modules() if isinstance(m, nn.Linear)}
        self._selected = self._select(pl_module)
        self._records = {fqn: LayerRecord(fqn, m.in_features, m.out_features, self.sqnr_threshold_db)
                         for fqn, m in self._layers.items()}
        self._local = dict.fromkeys(self._selected, UNDECIDED)
        self._generator = torch.Generator().manual_seed(trainer.global_rank)  # which rows a sample measures
        self._schedule.manual_seed(1_000_003)  # the same on every rank: a sample delays every rank, so they take it together

    def _select(self, pl_module: pl.LightningModule) -> list[str]:
        names = list(self._layers)
        if not names and self.include is None:
            rank_zero_warn(f"FP8Probe: {type(pl_module).__name__} has no nn.Linear layer (the GEMMs FP8 would run); "
                           "nothing to probe, so the probe is off for this fit.")
            return []
        listing = f"its nn.Linear layers are: {names}" if names else "it has no nn.Linear layer"
        for pattern in self.include or []:
            if not any(_matches(fqn, pattern) for fqn in names):
                raise ConfigurationError(f"FP8Probe(include=[..., {pattern!r}, ...]): the pattern matches no nn.Linear layer of "
                                         f"{type(pl_module).__name__}; {listing}. Patterns are fnmatch patterns of module names.")
        for pattern in self.exclude or []:
            if not any(_matches(fqn, pattern) for fqn in names):
                rank_zero_warn(f"FP8Probe(exclude=[..., {pattern!r}, ...]) matches no nn.Linear layer; {listing}.",
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
        saved_every = int((restored or {}).get("every_n_steps", self.every_n_steps))
        if saved_every != self.every_n_steps and restored and restored.get("records"):
            rank_zero_info(f"FP8Probe: the checkpoint's windows were {saved_every} steps long, this run's are "
                           f"every_n_steps={self.every_n_steps}: its windows are renumbered by their first step.")
        for fqn, vector in (restored or {}).get("records", {}).items():  # the job's windows at the checkpoint
            record = self._records.get(fqn)
            if record is not None and len(vector) == len(record.to_vector()):  # (a record of this version)
                loaded = LayerRecord.from_vectors(fqn, record.in_features, record.out_features, self.sqnr_threshold_db,
                                                  [vector])
                loaded.renumber_windows(saved_every, self.every_n_steps)
                if trainer.global_rank == 0:  # rank 0 carries them on: one copy counts in the job's verdict
                    self._records[fqn] = loaded
                else:  # the others decide what to sample with them in view, and report only their own
                    self._prior[fqn] = loaded
        for fqn in self._selected:
            self._local[fqn] = self._decision(fqn).verdict
        self._last_global_step = trainer.global_step

    # ------------------------------------------------------------------ sampling
    def _due(self) -> set[str]:
        """The layers to measure at this window: those being tested, and the safe ones at every ``recheck_every``-th."""
        recheck = self.opportunities % self.recheck_every == 0
        return {f for f, v in self._local.items() if v == UNDECIDED or (v == SAFE and recheck)}

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()
        self._probe_step_s = 0.0
        if self._sampling:  # the last sampled batch never reached its end (skipped by the module): no hook stays
            self._remove_hooks()
        if trainer.global_step < self.next_sample_step or accumulating(trainer):
            return  # (the common case first: this is every step's cost; one batch per optimizer step is sampled)
        self.opportunities += 1
        due = self._due()
        if not due:
            self.next_sample_step = self._next_sample(trainer.global_step, self.every_n_steps)
            return
        start = time.perf_counter()
        self._sampling = True
        self._hooks_fired = 0
        window = trainer.global_step // self.every_n_steps
        for fqn, module in self._layers.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(fqn, window, probe=fqn in due),
                                                              with_kwargs=True))
            self._records[fqn].observe_step()
        self._probe_step_s += time.perf_counter() - start

    def _forward_hook(self, fqn: str, window: int, probe: bool) -> Callable[..., None]:
        record = self._records[fqn]

        def hook(module: nn.Linear, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor) -> None:
            self._hooks_fired += 1
            x = args[0] if args else kwargs.get("input")
            if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor) or x.numel() == 0:
                return  # (a layer given no rows this step, e.g. an expert no token chose: nothing to measure)
            record.observe_rows(x.numel() // max(module.in_features, 1))
            if probe:
                start = _settled_clock(x)
                rows = x.detach().reshape(-1, module.in_features)
                weight = module.weight.detach()
                sample = sample_forward(rows, weight, compute_dtype(x, output), self._recipe, self.max_rows,
                                        self._generator)
                record.add(window, measure_output(sample, self._recipe))  # the forward GEMM: frozen layers too
                record.observe_amax("input", rows)
                record.observe_amax("weight", weight)
                grad_input, grad_weight = x.requires_grad, module.weight.requires_grad
                if torch.is_grad_enabled() and output.requires_grad and (grad_input or grad_weight):

                    def on_grad(grad: torch.Tensor) -> None:
                        began = _settled_clock(grad)
                        grad_rows = grad.detach().reshape(-1, module.out_features)
                        record.observe_amax("grad_output", grad_rows)
                        for result in measure_backward(sample, grad_rows, self._recipe, grad_input, grad_weight):
                            record.add(window, result)
                        self._probe_step_s += time.perf_counter() - began

                    output.register_hook(on_grad)
                self._probe_step_s += time.perf_counter() - start

        return hook

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._sampling = False

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        # in optimizer steps, the unit of every_n_steps and of the interval (a batch may only accumulate)
        self.train_steps += max(trainer.global_step - self._last_global_step, 0)
        self._last_global_step = trainer.global_step
        if not self._sampling:
            self.train_s += now - self._batch_start
            return
        self._remove_hooks()
        if not self._hooks_fired and not self._warned_no_hooks:
            self._warned_no_hooks = True
            rank_zero_warn("FP8Probe: a sampled training step ran none of the probed layers' forward hooks, so nothing "
                          "was measured. A module compiled with torch.compile does not run hooks added after its "
                          "compilation (Dynamo skips nn.Module hook guards): probe an eager run, or set "
                          "torch._dynamo.config.skip_nnmodule_hook_guards = False before compiling.", stacklevel=2)
        self._update_verdicts(trainer)
        self._probe_step_s += time.perf_counter() - now
        self.probe_s += self._probe_step_s
        self.train_s += max(time.perf_counter() - self._batch_start - self._probe_step_s, 0.0)
        self.samples_taken += 1
        sampled = trainer.global_step - 1  # (the step that just ran: global_step counts it already)
        self.sampled_steps.append(sampled)
        self.next_sample_step = self._next_sample(sampled, self._interval(self._probe_step_s))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._failed = True  # (before any checkpoint callback's on_exception: Lightning runs those last)
        self._remove_hooks()  # nothing of the probe stays on a model whose fit failed

    def _update_verdicts(self, trainer: pl.Trainer) -> None:
        """This rank's verdicts after a sample; a safe layer found bad by a re-check is said at once, on this rank."""
        for fqn, before in self._local.items():
            if before == UNSAFE:
                continue
            found = self._decision(fqn)
            self._local[fqn] = found.verdict
            if before == SAFE and found.verdict == UNSAFE:
                event = {"layer": fqn, "step": trainer.global_step - 1, "sqnr_db": found.bad_db, "rank": trainer.global_rank}
                self.turned_unsafe.append(event)
                warnings.warn(f"FP8Probe: {fqn}, safe until now, is unsafe: its re-checks found {found.bad_windows} "
                              f"window(s) below {self.sqnr_threshold_db:g} dB, the last at step {event['step']} (rank "
                              f"{trainer.global_rank}, {found.bad_db:.1f} dB).", stacklevel=2)
        if trainer.is_global_zero and trainer.loggers:
            counts = {f"fp8/{v}_layers": float(sum(x == v for x in self._local.values())) for v in (SAFE, UNSAFE, UNDECIDED)}
            for logger in trainer.loggers:
                logger.log_metrics(counts, step=trainer.global_step)

    def _decision(self, fqn: str) -> Decision:
        """This rank's view of a layer: its own windows, after the job's from the checkpoint it resumed from."""
        return self._records[fqn].decision(self.tail, self.confidence, self._prior.get(fqn))

    def _next_sample(self, after: int, interval: int) -> int:
        """The step of the next sample: ``interval`` steps after ``after`` on average, at a random distance (half to
        one and a half times it), and in a later window. A fixed stride aliases with periodic work — a layer run
        every other step, a branch taken on odd batches — and never sees it, or sees it at every sample."""
        jitter = int(torch.randint(interval, (1,), generator=self._schedule))
        next_window = (after // self.every_n_steps + 1) * self.every_n_steps
        return max(after + interval // 2 + 1 + jitter, next_window)

    def _interval(self, sample_cost_s: float) -> int:
        """Steps to the next sample: at least ``every_n_steps``; enough that a sample's cost is ``max_overhead`` of
        the training between, and that the running total stays within budget.

        A sample's cost is the median of the recent ones: a pause that lands in one (the host
        descheduling the process, a GC) would otherwise stop sampling for a hundred times its
        length. :attr:`overhead` still reports every second measured."""
        self._sample_costs.append(sample_cost_s)
        cost = statistics.median(self._sample_costs)
        step_s = self.train_s / max(self.train_steps, 1)
        if step_s <= 0:
            return self.every_n_steps
        for_this = cost / (self.max_overhead * step_s)
        to_catch_up = (self.samples_taken * cost / self.max_overhead - self.train_s) / step_s
        return max(self.every_n_steps, math.ceil(for_this), math.ceil(to_catch_up))

    @property
    def overhead(self) -> float:
        """The probe's measured time as a share of training time on this rank, so far."""
        return self.probe_s / self.train_s if self.train_s else 0.0

    # ------------------------------------------------------------------ the verdict
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()
        if not self._records:
            return
        vectors = [record.to_vector() for record in self._records.values()]
        timing = [self.probe_s, self.train_s, float(self.samples_taken), float(self.train_steps)]
        local = torch.tensor(vectors + [timing + [0.0] * (len(vectors[0]) - len(timing))], dtype=torch.float64)
        gathered = all_gather(trainer, local).cpu()  # the one collective
        combined = combine(self._records, gathered[:, :-1])
        per_rank = gathered[:, -1, :len(timing)]
        self._overheads = [float(p[0] / p[1]) if p[1] else 0.0 for p in per_rank]
        steps = max(float(p[3]) for p in per_rank)
        self.results = self._results(combined, steps)
        if trainer.is_global_zero:
            self._publish(trainer)

    def _results(self, combined: dict[str, LayerRecord], steps: float) -> dict[str, dict[str, Any]]:
        total_flops = sum(r.flops() for r in combined.values()) or 1.0
        results = {}
        for fqn in self._selected:
            record = combined[fqn]
            summary = record.summary(self.tail, self.confidence)
            summary["eligible"] = eligible(self._layers[fqn], fqn, self.recipe)
            summary["flop_share"] = record.flops() / total_flops
            rel = [g["rel_error_mean"] for g in summary["gemms"].values() if g.get("rel_error_mean") is not None]
            summary["relative_error"] = max(rel) if rel else None
            summary["turned_unsafe"] = summary["safe_at_window"] is not None and summary["unsafe_at_window"] is not None
            summary["reason"] = self._reason(summary, steps)
            results[fqn] = summary
        return results

    def _reason(self, r: dict[str, Any], steps: float) -> str:
        """Why the verdict is what it is, in words a user can act on."""
        below = f"{r['bad_windows']} of {r['samples']} windows below {self.sqnr_threshold_db:g} dB"
        per_gemm = ", ".join(f"{g} {_num(v)}" for g, v in r["sqnr_db_worst_per_gemm"].items())
        if r["verdict"] == UNSAFE:
            step = r["unsafe_at_window"] * self.every_n_steps
            after = (f"after being safe from step ~{r['safe_at_window'] * self.every_n_steps}, "
                     if r["turned_unsafe"] else "")
            return f"{after}{below}; decided at step ~{step}; worst dB per GEMM: {per_gemm}"
        if r["verdict"] == SAFE:
            return f"{below}; worst dB per GEMM: {per_gemm}"
        if not r["measured_gemms"]:
            if self._warned_no_hooks:
                return ("never measured: no probed layer ran its hooks in a sampled step (a module compiled with "
                        "torch.compile runs no hook added after its compilation: probe an eager run)")
            return (f"never measured: the layer did not run in any of the {self.samples_taken} sampled step(s) (a layer "
                    "used in some steps only); more steps would reach it")
        per_window = steps / max(r["samples"], 1)  # this layer's own pace (one that skips steps gets fewer windows)
        more = math.ceil((r["samples_needed"] - r["samples"]) * per_window)
        correlated = (f"; windows are autocorrelated (rho {r['autocorrelation']:.2f}), each counts "
                      f"{(1 - r['autocorrelation']) / (1 + r['autocorrelation']):.2f}" if r["autocorrelation"] else "")
        if per_window <= 1.1 * self.every_n_steps:  # the window, not the budget, set the pace
            return (f"{below}, {r['samples_needed']} needed{correlated}: a window every every_n_steps="
                    f"{self.every_n_steps} steps; ~{more} more steps, or a smaller every_n_steps, would decide it")
        return (f"{below}, {r['samples_needed']} needed{correlated}: a window every ~{per_window:.0f} steps (the "
                f"{self.max_overhead:.0%} budget, and the steps the layer ran in); ~{more} more steps, or a larger "
                "max_overhead, would decide it")

    def summary_line(self) -> str:
        chosen = [r for r in self.results.values() if r["verdict"] == SAFE and r["eligible"]]
        share = 100 * sum(r["flop_share"] for r in chosen)
        line = f"FP8-safe and eligible: {len(chosen)} of {len(self.results)} layers, {share:.1f}% of GEMM FLOPs"
        turned = [f for f, r in self.results.items() if r["turned_unsafe"]]
        undecided = sum(r["verdict"] == UNDECIDED for r in self.results.values())
        if turned:
            line += f"; turned unsafe after being safe: {', '.join(turned)}"
        if undecided:
            line += f"; {undecided} undecided (why: fp8_probe.json)"
        return line

    def module_filter_fn(self, require_eligible: bool = True, prefix: str = "") -> Callable[[nn.Module, str], bool]:
        """``(module, fqn) -> bool`` for torchao's ``convert_to_float8_training``: the layers found safe (and eligible).

        Names are those of this LightningModule's modules. Applied to a submodule
        (``lightning_module.model``), pass its name as ``prefix`` (``"model"``); without it, a
        name is matched by its tail only where the tail is unique — ``"2"`` in a model with
        ``enc.2`` and ``dec.2`` matches neither, rather than risk the unsafe one.
        ``require_eligible=False`` also selects safe layers below torchao's FP8 sizes.
        """
        chosen = {f for f, r in self.results.items() if r["verdict"] == SAFE and (r["eligible"] or not require_eligible)}
        probed = list(self.results)

        def module_filter(module: nn.Module, fqn: str) -> bool:
            if not isinstance(module, nn.Linear):
                return False
            if prefix:
                return f"{prefix}.{fqn}" in chosen
            matches = [name for name in probed if name == fqn or name.endswith("." + fqn)]
            return len(matches) == 1 and matches[0] in chosen

        return module_filter

    # ------------------------------------------------------------------ where the results go (rank zero)
    def _publish(self, trainer: pl.Trainer) -> None:
        line = self.summary_line()
        verdicts = [r["verdict"] for r in self.results.values()]
        chosen = [r for r in self.results.values() if r["verdict"] == SAFE and r["eligible"]]
        turned = sum(r["turned_unsafe"] for r in self.results.values())
        payload = {"recipe": self.recipe, "sqnr_threshold_db": self.sqnr_threshold_db, "tail": self.tail,
                   "confidence": self.confidence, "every_n_steps": self.every_n_steps, "max_overhead": self.max_overhead,
                   "overhead_per_rank": self._overheads, "samples_taken": self.samples_taken, "summary": line,
                   "layers": self.results}
        path = _run_dir(trainer) / RESULTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(payload, indent=2) + "\n")
        self._print_table(line)  # (after the file: what the console cannot show is there)
        get_timeline().fact(FP8_FACT, recipe=self.recipe, layers=len(self.results), safe_and_eligible=len(chosen),
                            flop_share=sum(r["flop_share"] for r in chosen), unsafe=verdicts.count(UNSAFE),
                            undecided=verdicts.count(UNDECIDED), turned_unsafe=turned)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                columns, rows = self._table_rows()
                logger.log_table(key="fp8/probe", columns=columns, data=rows)
                logger.experiment.summary.update({"fp8/safe_and_eligible_layers": len(chosen), "fp8/layers": len(self.results),
                                                  "fp8/safe_and_eligible_flop_share": sum(r["flop_share"] for r in chosen),
                                                  "fp8/unsafe_layers": verdicts.count(UNSAFE),
                                                  "fp8/turned_unsafe_layers": turned,
                                                  "fp8/undecided_layers": verdicts.count(UNDECIDED)})

    def _table_rows(self) -> tuple[list[str], list[list[Any]]]:
        quantile = f"sqnr_db_q{round(100 * self.tail)}"
        columns = ["layer", "verdict", "eligible", quantile, "sqnr_db_worst", "samples", "samples_needed", "flop_share",
                   "M", "K", "N", "measured_gemms", "amax_input", "flushed_input", "reason"]
        rows = [[fqn, r["verdict"], r["eligible"], r[quantile], r["sqnr_db_worst"], r["samples"], r["samples_needed"],
                 r["flop_share"], r["shape"]["M"], r["shape"]["K"], r["shape"]["N"], "+".join(r["measured_gemms"]),
                 r["amax"]["input"], r["flushed_share"]["input"], r["reason"]] for fqn, r in self.results.items()]
        return columns, rows

    def _print_table(self, line: str) -> None:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=f"FP8Probe ({self.recipe}: {self.tail:.0%} of steps may fall below "
                      f"{self.sqnr_threshold_db:g} dB, at {self.confidence:.0%} confidence)")
        table.add_column("layer", no_wrap=True, min_width=max(map(len, self.results), default=5), overflow="fold")
        for column in ("verdict", "eligible", f"SQNR q{round(100 * self.tail)}/worst dB", "windows", "FLOPs", "M×K×N"):
            table.add_column(column, overflow="fold")
        style = {"safe": "green", "unsafe": "red", UNDECIDED: "yellow"}
        quantile = f"sqnr_db_q{round(100 * self.tail)}"
        for fqn, r in self.results.items():
            windows = f"{r['samples']}/{r['samples_needed']}" if r["samples_needed"] else str(r["samples"])
            table.add_row(escape(fqn), f"[{style[r['verdict']]}]{r['verdict']}[/]", "yes" if r["eligible"] else "no",
                          f"{_num(r[quantile])} / {_num(r['sqnr_db_worst'])}", windows,
                          f"{100 * r['flop_share']:.1f}%", f"{r['shape']['M']}×{r['shape']['K']}×{r['shape']['N']}")
        console = Console()
        longest = max(map(len, self.results), default=5)
        if not console.is_terminal:  # (a log file: rich's 80 columns would squeeze the names out of the table)
            console = Console(width=max(console.width, longest + 80))
        else:  # a terminal: the names may wrap rather than crush the numbers
            table.columns[0].no_wrap, table.columns[0].min_width = False, min(longest, console.width // 2)
        console.print(table)
        for fqn, r in self.results.items():
            console.print(escape(f"  {fqn}: {r['verdict']}: {r['reason']}"), highlight=False)
        console.print(escape(line))

    # ------------------------------------------------------------------ state
    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Put the whole job's windows where Lightning keeps rank 0's state: every rank runs this hook (as it runs
        ``dump_checkpoint``), so one all-gather here is collective; a resumed run then restores every rank's
        windows, not just rank 0's."""
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is None or not self._records or trainer.world_size < 2 or self._restored is not None:
            return
        if self._failed or trainer.interrupted:  # a save in an exception's wake may run on one rank only (Lightning's
            return  # OnExceptionCheckpoint, save_on_exception): no collective that would hang it; rank 0's windows
        local = torch.tensor([record.to_vector() for record in self._records.values()], dtype=torch.float64)
        gathered = all_gather(trainer, local).cpu()
        state["records"] = {f: r.to_vector() for f, r in combine(self._records, gathered).items()}

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._restored is not None:  # loaded, not applied yet (no training step ran since): passed on as it came
            return dict(self._restored)
        return {"records": {f: r.to_vector() for f, r in self._records.items()}, "next_sample_step": self.next_sample_step,
                "opportunities": self.opportunities, "probe_s": self.probe_s, "train_s": self.train_s,
                "train_steps": self.train_steps, "samples_taken": self.samples_taken, "every_n_steps": self.every_n_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next_sample_step = int(state_dict.get("next_sample_step", self.every_n_steps))
        self.opportunities = int(state_dict.get("opportunities", 0))
        self.probe_s = float(state_dict.get("probe_s", 0.0))
        self.train_s = float(state_dict.get("train_s", 0.0))
        self.train_steps = int(state_dict.get("train_steps", 0))
        self.samples_taken = int(state_dict.get("samples_taken", 0))
        self._restored = state_dict  # the windows: applied on rank 0 only, at train start


def _settled_clock(tensor: torch.Tensor) -> float:
    """``perf_counter()`` once the device has run what is queued before ``tensor`` (CUDA; on CPU the work is done).

    Without it the probe's first result read waits for the training step's queued kernels and the wait counts as
    the probe's time: overhead overstated, samples rarer than the budget allows."""
    if tensor.is_cuda:  # GPU only: CUDA kernels run asynchronously to the host
        torch.cuda.current_stream(tensor.device).synchronize()  # (this stream's work only: not NCCL's, not a peer's)
    return time.perf_counter()


def _validate(every_n_steps: Any, threshold: Any, tail: Any, confidence: Any, max_overhead: Any, recipe: Any) -> None:
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
        raise ConfigurationError(f"FP8Probe(every_n_steps={every_n_steps!r}): expected an int >= 1.")
    if not number(threshold) or not 0 < threshold < 100:
        raise ConfigurationError(f"FP8Probe(sqnr_threshold_db={threshold!r}): expected a number of dB in (0, 100), e.g. "
                                 f"{DEFAULT_SQNR_THRESHOLD_DB:g} (an RMS error of 10% of the GEMM's output).")
    if not number(tail) or not 0 < tail < 1:
        raise ConfigurationError(f"FP8Probe(tail={tail!r}): expected the share of steps allowed below the threshold, "
                                 "strictly between 0 and 1, e.g. 0.1.")
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
