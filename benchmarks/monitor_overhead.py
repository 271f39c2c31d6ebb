"""Step-time overhead of ETTMonitor on the DLRM example on 2 ranks, measured side by side in one run.

    .venv/bin/python benchmarks/monitor_overhead.py [--rounds 5] [--steps 150]

Every run is a 2-rank job (this script with ``--worker``: the example's model and data under
ETTStrategy, Lightning's launcher, gloo), so ETTMonitor's straggler all-gather runs as in a
real job. Each round runs three arms in rotated order: without ETTMonitor, with it, and without
it again (the A/A control: the noise floor). Every training step is timed with a timestamp at
``on_train_batch_end`` (the same in all arms); rank 0's are used. Prints per round the ratio of
median step times (with ÷ without) and of total time ÷ steps over the timed window, the
medians of those ratios (goal: <= 1.01) against the A/A floor, and what ETTMonitor's own hooks
took per step on rank 0: every Lightning hook the monitor implements is timed in the run with it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.spread import aa_floor, against_floor, median_range, round_order
from examples.dlrm_example import DLRMModule, RandomCriteoDataModule
from lightning_ett import ETTMonitor, ETTStrategy

ARMS = ("without", "with", "without A/A")


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


def worker(with_monitor: bool, steps: int, warmup: int, workdir: Path, out: Path) -> None:
    """One 2-rank run; rank 0 writes its median step, window ÷ steps and hook time per step to ``out``."""
    pl.seed_everything(0, verbose=False)
    clock = StepClock()
    callbacks: list[Callback] = [clock]
    spent: dict[str, float] = {}
    if with_monitor:
        monitor = ETTMonitor(run_dir=workdir / "ett", log_every_n_steps=50, report_on_end=False)
        spent = time_hooks(monitor)
        callbacks.insert(0, monitor)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ETTStrategy(), max_steps=steps, limit_val_batches=0,
        logger=CSVLogger(workdir / "logs"), log_every_n_steps=50, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(DLRMModule(), RandomCriteoDataModule(batch_size=512))
    if trainer.global_rank != 0:
        return
    stamps = clock.stamps[warmup:]
    per_step = {name: seconds / steps for name, seconds in spent.items()
                if not name.startswith(("on_fit", "on_train_start", "on_train_end"))}
    out.write_text(json.dumps({"median_step_s": statistics.median(b - a for a, b in itertools.pairwise(stamps)),
                               "window_per_step_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1),
                               "hook_s_per_step": sum(per_step.values())}))


def run(with_monitor: bool, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    out = workdir / "result.json"
    workdir.mkdir(parents=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    environ["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run([sys.executable, __file__, "--worker", "--with-monitor", str(int(with_monitor)), "--steps",
                           str(args.steps), "--warmup", str(args.warmup), "--workdir", str(workdir), "--out", str(out)],
                          env=environ, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the run {'with' if with_monitor else 'without'} ETTMonitor failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


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
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--with-monitor", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(bool(args.with_monitor), args.steps, args.warmup, Path(args.workdir), Path(args.out))
        return
    runs: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = round_order(ARMS, r)
            for arm in order:
                runs[arm].append(run(arm == "with", args, Path(tmp) / f"r{r}-{arm.replace(' ', '').replace('/', '')}"))
            wo, w, aa = (runs[a][-1] for a in ARMS)
            print(f"round {r + 1} ({', '.join(order)}): median step {wo['median_step_s'] * 1e3:.2f} ms without, "
                  f"{w['median_step_s'] * 1e3:.2f} with, {aa['median_step_s'] * 1e3:.2f} without again -> ratio "
                  f"{w['median_step_s'] / wo['median_step_s']:.4f} (A/A {aa['median_step_s'] / wo['median_step_s']:.4f}); "
                  f"its hooks {w['hook_s_per_step'] * 1e6:.0f} us/step", flush=True)

    def ratios(key: str, arm: str) -> list[float]:
        return [a[key] / b[key] for a, b in zip(runs[arm], runs["without"])]

    for key, label in (("median_step_s", "median step"), ("window_per_step_s", "total time ÷ steps")):
        ratio, aa = ratios(key, "with"), ratios(key, "without A/A")
        floor = aa_floor(aa)
        verdict = against_floor(ratio, floor)
        print(f"ETTMonitor {label} ratio over {args.rounds} rounds: {median_range(ratio, '.4f')} (goal <= 1.01); "
              f"A/A {median_range(aa, '.4f')} (floor ±{floor:.4f}): {verdict}")
    hooks = statistics.median(x["hook_s_per_step"] for x in runs["with"])
    step = statistics.median(x["median_step_s"] for x in runs["without"])
    print(f"ETTMonitor's hooks on rank 0, timed in place: median {hooks * 1e6:.0f} us per step = "
          f"{100 * hooks / step:.3f} % of a {step * 1e3:.1f} ms step")
    print(f"ledger write per step (isolated): {per_step_hook_cost_us():.1f} us")


if __name__ == "__main__":
    main()
