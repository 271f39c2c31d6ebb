"""What a trial's run directory says: training throughput, start-up, save cost, and how it ended.

Read from the ETT ledger every trial writes (ETTMonitor under ``lightning run``):

* **throughput** (samples/s, the job's): for each rank, its batch size (ETTMonitor's ``batch``
  fact) over its median training step, summed over ranks. A ``train`` event runs from the end of
  the previous step to the end of this one, so data loading counts. Left out: the first steps
  (warm-up: the first 10 % of the trial, at least 3) and every step that a ``compile`` event
  overlaps — what a trial of a few hundred steps must not mistake for the steady state.
* **startup_s**: from the job's start to its first training step (launch, imports, process
  group, model, plan, data, compiles before the first step).
* **save_cost_s**: what one checkpoint save cost training, as AsyncCheckpoint measured it (its
  cadence fact), when the trial saved; **save_interval_steps** and **cadence_mode**: the interval
  it saved at and whether it was fixed or ``"auto"`` (from the same fact).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ett.instrument.ledger import read_ledger
from lightning_ett.instrument.summary import summarize_run_dir
from lightning_ett.instrument.timeline import BATCH_FACT, CADENCE_FACT, Phase

STARTUP_PHASES = ("launch", "import", "trainer_init", "lightning_launcher", "process_group_init", "logger_init",
                  "model_init", "sharding_plan", "data_init")


@dataclass(frozen=True)
class Measurement:
    ok: bool
    reason: str | None = None  # why not ok
    throughput: float | None = None
    step_s: float | None = None  # the median steady step, mean over ranks
    steps_counted: int = 0
    startup_s: float | None = None
    save_cost_s: float | None = None
    save_interval_steps: int | None = None
    cadence_mode: str | None = None  # "fixed" or "auto"
    phases: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def measure(run_dir: Path, steps: int) -> Measurement:
    """``run_dir``: a finished trial's ledger; ``steps``: how many it was to train."""
    try:
        summary = summarize_run_dir(run_dir)
    except (FileNotFoundError, ValueError) as err:
        return Measurement(False, f"no ETT ledger: {err}")
    failure = next((a.failure for a in reversed(summary.attempts) if a.failure), None)
    if summary.outcome not in (None, "finished") or failure:
        return Measurement(False, failure or summary.outcome, phases=summary.phases)
    every = read_ledger(run_dir)
    if not every:
        return Measurement(False, f"no rank ledger in {str(run_dir)!r}", phases=summary.phases)
    last_attempt = max(lg.attempt for lg in every)
    ledgers = [lg for lg in every if lg.attempt == last_attempt]
    warmup = max(3, steps // 10)
    throughput, step_times, counted, first_step = 0.0, [], 0, None
    for ledger in ledgers:
        samples = next((f.get("samples") for f in ledger.facts if f.get("name") == BATCH_FACT), None)
        compiles = [(e["start"], e["end"]) for e in ledger.events if e["phase"] == Phase.COMPILE.value]
        train = [e for e in ledger.events if e["phase"] == Phase.TRAIN.value and e.get("step") is not None]
        if train:
            starts = min(e["start"] for e in train)
            first_step = starts if first_step is None else min(first_step, starts)
        steady = [e["end"] - e["start"] for e in train if e["step"] >= warmup
                  and not any(s < e["end"] and e["start"] < end for s, end in compiles)]
        if not steady or not samples:
            why = "no batch size recorded (is ETTMonitor in the callbacks?)" if not samples else \
                f"no steady training step after the first {warmup} (raise --steps)"
            return Measurement(False, f"rank {ledger.rank}: {why}", phases=summary.phases)
        median = statistics.median(steady)
        throughput += samples / median
        step_times.append(median)
        counted += len(steady)
    cadence = summary.facts_named(CADENCE_FACT)
    last = cadence[-1] if cadence else {}
    save_cost = float(last["save_cost_s"]) if cadence else None
    interval = int(last["interval_steps"]) if cadence else None
    startup = (first_step - summary.job_start) if first_step is not None else None
    return Measurement(True, None, throughput, statistics.mean(step_times), counted, startup, save_cost, interval,
                       last.get("mode"), summary.phases)
