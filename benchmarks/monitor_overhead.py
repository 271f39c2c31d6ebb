"""Step-time overhead of ETTMonitor on the DLRM example, measured side by side in one run.

    .venv/bin/python benchmarks/monitor_overhead.py [--pairs 5] [--steps 150]

Runs the example's model and data in this process, in pairs of runs without and with
ETTMonitor whose order alternates from pair to pair (AB, BA, ...: neither arm always runs
first), and times every training step with a timestamp at ``on_train_batch_end`` (the same in
both arms). Prints each pair's ratio of median step times and the median of those ratios
(goal: <= 1.01), and what ETTMonitor's own hooks took per step: every Lightning hook the
monitor implements is timed in the run with it.
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


def time_hooks(callback: Callback) -> dict[str, float]:
    """Wrap every hook ``callback`` overrides with a timer; returns the seconds spent per hook (filled in as it runs)."""
    spent: dict[str, float] = {}
    for name in dir(Callback):
        if not name.startswith("on_") or getattr(type(callback), name) is getattr(Callback, name):
            continue
        hook = getattr(callback, name)

        def timed(*args: object, _hook=hook, _name=name, **kwargs: object) -> object:  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return _hook(*args, **kwargs)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - start

        setattr(callback, name, timed)
    return spent


def median_step_s(with_monitor: bool, steps: int, warmup: int, workdir: Path, hook_s: list[float] | None = None) -> float:
    pl.seed_everything(0, verbose=False)
    clock = StepClock()
    callbacks: list[Callback] = [clock]
    spent: dict[str, float] = {}
    if with_monitor:
        monitor = ETTMonitor(run_dir=workdir / "ett", log_every_n_steps=50, report_on_end=False)
        spent = time_hooks(monitor)
        callbacks.insert(0, monitor)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, logger=CSVLogger(workdir / "logs"),
        log_every_n_steps=50, callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(DLRMModule(), RandomCriteoDataModule(batch_size=512))
    deltas = [b - a for a, b in zip(clock.stamps[warmup:], clock.stamps[warmup + 1 :])]
    if hook_s is not None and spent:
        per_step = {name: seconds / steps for name, seconds in spent.items() if not name.startswith(("on_fit", "on_train_start",
                                                                                                   "on_train_end"))}
        hook_s.append(sum(per_step.values()))
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
    ratios, hook_s, steps_s = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            step: dict[bool, float] = {}
            order = (False, True) if pair % 2 == 0 else (True, False)
            for with_monitor in order:
                step[with_monitor] = median_step_s(with_monitor, args.steps, args.warmup,
                                                   Path(tmp) / f"{'ett' if with_monitor else 'base'}{pair}", hook_s)
            base, ours = step[False], step[True]
            ratios.append(ours / base)
            steps_s.append(base)
            first = "without first" if order[0] is False else "with first"
            print(f"pair {pair} ({first}): median step {base * 1e3:.2f} ms without, {ours * 1e3:.2f} ms with ETTMonitor "
                  f"-> ratio {ratios[-1]:.4f}; its hooks {hook_s[-1] * 1e6:.0f} us/step")
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else (ratios[0],) * 3
    print(f"ETTMonitor step-time ratio (median of {args.pairs} pairs): {statistics.median(ratios):.4f} "
          f"(IQR {q1:.4f}-{q3:.4f})  (goal <= 1.01)")
    print(f"ETTMonitor's hooks, timed in place: median {statistics.median(hook_s) * 1e6:.0f} us per step = "
          f"{100 * statistics.median(hook_s) / statistics.median(steps_s):.3f} % of a step")
    print(f"ledger write per step (isolated): {per_step_hook_cost_us():.1f} us")


if __name__ == "__main__":
    main()
