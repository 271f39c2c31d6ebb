"""ETTMonitor's straggler diagnosis in a Lightning job: the stamps, the gather every N batches, the verdict.

The method and what it can and cannot see: :mod:`lightning_ett.watch.stragglers`. Also applies
``LIGHTNING_ETT_FAULT_SLOW`` (:func:`lightning_ett.lifecycle.faults.slow_fault_from_env`) to the named
rank, for tests and benchmarks.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ett.callbacks.collectives import all_gather
from lightning_ett.instrument.step_health import StepHealth
from lightning_ett.instrument.step_marks import listen_for_data_read
from lightning_ett.instrument.timeline import STRAGGLER_FACT, get_timeline
from lightning_ett.lifecycle.faults import SlowFault
from lightning_ett.patching import Patches
from lightning_ett.watch.stragglers import ORIGIN_GATHERS, StragglerTracker, WindowStamps, window_scores


class StragglerProbe:
    """Stamps each batch locally; every ``every_n`` batches one tiny all-gather; rank 0 judges and records.

    Every rank counts the same batches, so every rank calls the gather at the same batch and the
    collectives pair. Only the host clock is read: the device is never synchronized, except by the
    gather itself (a CPU copy of its result), once per window.
    """

    def __init__(self, every_n: int, threshold: float, fault: SlowFault | None = None) -> None:
        self.every_n = every_n
        self.threshold = threshold
        self.fault = fault
        self.enabled = False
        self._stamps: WindowStamps | None = None
        self._tracker = StragglerTracker(threshold)
        self._forward_stamps = True

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, patches: Patches) -> None:
        self.enabled = self.every_n > 0 and trainer.world_size > 1
        if self.enabled:
            patches.call_on_undo(listen_for_data_read(self._data_read))
        if self.fault is not None and self.fault.rank == trainer.global_rank:
            _slow_down(self.fault, trainer, pl_module, patches)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A fit starts: a new first window (every rank does this at the same point)."""
        self._stamps = WindowStamps(self.every_n) if self.enabled else None
        self._forward_stamps = pl_module.automatic_optimization  # manual: the user's backward calls are anyone's guess

    def on_batch_start(self, trainer: pl.Trainer, health: StepHealth) -> None:
        """``health``: this rank's step times; rank zero's ideal step sets the threshold."""
        stamps = self._stamps
        if stamps is None:
            return
        ready = time.perf_counter()
        if stamps.full:
            self._gather(trainer, stamps, health)
        stamps.ready(ready)  # stamped before the gather: its lateness is measured from the new origin

    def _data_read(self, t: float) -> None:
        if self._stamps is not None:
            self._stamps.data_read(t)

    def on_before_backward(self) -> None:
        if self._stamps is not None and self._forward_stamps:
            self._stamps.forward_done(time.perf_counter())

    def _gather(self, trainer: pl.Trainer, stamps: WindowStamps, health: StepHealth) -> None:
        row = torch.tensor(stamps.row(), dtype=torch.float64, device=trainer.strategy.root_device)
        first = not stamps.leaves
        rows = all_gather(trainer, row).cpu().numpy()  # the copy waits for the gather to complete
        stamps.restart(time.perf_counter())  # the instant this rank left the gather: the next window's origin
        for _ in range(ORIGIN_GATHERS - 1 if first else 0):  # more samples of the clock offsets, once
            all_gather(trainer, row[:1]).cpu()
            stamps.left(time.perf_counter())
        if not trainer.is_global_zero:
            return
        window = window_scores(rows.reshape(trainer.world_size, -1))
        if window is None:
            return  # the first window only sets the origin
        verdict = self._tracker.observe(window, health.ideal_s)
        get_timeline().fact(STRAGGLER_FACT, step=trainer.global_step, **verdict.fact())
        if verdict.warn:
            rank_zero_warn(verdict.message())

    def metrics(self) -> dict[str, float]:
        """``ett/straggler_rank`` (-1: none) and ``ett/straggler_score_s`` (the highest score), once a window was judged."""
        latest = self._tracker.latest
        if latest is None:
            return {}
        rank = latest.straggler if latest.straggler is not None else -1
        return {"ett/straggler_rank": float(rank), "ett/straggler_score_s": latest.score_s}


def _slow_down(fault: SlowFault, trainer: pl.Trainer, pl_module: pl.LightningModule, patches: Patches) -> None:
    """Make this rank a straggler: ``fault.seconds`` more in every data fetch, or in every forward."""
    seconds = fault.seconds
    if fault.where == "compute":
        step = pl_module.training_step

        def slow_training_step(*args: Any, **kwargs: Any) -> Any:
            output = step(*args, **kwargs)
            time.sleep(seconds)  # in the forward, before the backward
            return output

        patches.setattr(pl_module, "training_step", slow_training_step)
        return
    # Lightning's training fetcher calls the epoch loop's `_on_after_fetch` inside every fetch (in
    # `_DataFetcher.__next__`, right after the data loader's `next`); the loop hands its bound method
    # to the fetcher at each epoch's start, so an instance attribute set now is what every fetch calls.
    loop = trainer.fit_loop.epoch_loop
    after_fetch = loop._on_after_fetch

    def slow_after_fetch() -> None:
        time.sleep(seconds)  # still inside the fetch, as a slower data pipeline would be
        after_fetch()

    patches.setattr(loop, "_on_after_fetch", slow_after_fetch)
