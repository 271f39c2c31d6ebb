"""Step-time overhead of ETTMonitor on the DLRM example, measured side by side in one run.

    .venv/bin/python benchmarks/monitor_overhead.py [--pairs 5] [--steps 150]

Runs the example's model and data in this process, alternating runs without and with
ETTMonitor (A/B pairs, so drift on a noisy machine hits both arms), and times every training
step with a timestamp at ``on_train_batch_end`` (the same in both arms). Prints each pair's
ratio of median step times and the median of those ratios. Goal: <= 1.01.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.dlrm_example import DLRMModule, RandomCriteoDataModule
from lightning_ett import ETTMonitor


class StepClock(Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, *args: object) -> None:
        self.stamps.append(time.perf_counter())


def median_step_s(with_monitor: bool, steps: int, warmup: int, workdir: Path) -> float:
    pl.seed_everything(0, verbose=False)
    clock = StepClock()
    callbacks: list[Callback] = [clock]
    if with_monitor:
        callbacks.insert(0, ETTMonitor(run_dir=workdir / "ett", log_every_n_steps=50, report_on_end=False))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, logger=CSVLogger(workdir / "logs"),
        log_every_n_steps=50, callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(DLRMModule(), RandomCriteoDataModule(batch_size=512))
    deltas = [b - a for a, b in zip(clock.stamps[warmup:], clock.stamps[warmup + 1 :])]
    return statistics.median(deltas)


def per_step_hook_cost_us(n: int = 20_000) -> float:
    """What the monitor adds per step outside the model: one train event into a real ledger."""
    from lightning_ett.instrument.timeline import Timeline

    with tempfile.TemporaryDirectory() as tmp:
        timeline = Timeline()
        timeline.bind(Path(tmp), rank=0, attempt=0, header={})
        start = time.perf_counter()
        for step in range(n):
            now = time.time()
            timeline.record("train", now, now, step)
        cost = (time.perf_counter() - start) / n
        timeline.close()
    return cost * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            base = median_step_s(False, args.steps, args.warmup, Path(tmp) / f"base{pair}")
            ours = median_step_s(True, args.steps, args.warmup, Path(tmp) / f"ett{pair}")
            ratios.append(ours / base)
            print(f"pair {pair}: median step {base * 1e3:.2f} ms without, {ours * 1e3:.2f} ms with ETTMonitor "
                  f"-> ratio {ratios[-1]:.4f}")
    print(f"ETTMonitor step-time ratio (median of {args.pairs} pairs): {statistics.median(ratios):.4f}  (goal <= 1.01)")
    print(f"ledger write per step (isolated): {per_step_hook_cost_us():.1f} us")


if __name__ == "__main__":
    main()
