"""What a trial is worth: its steady throughput, or the samples a whole job would train per hour of wall time.

* ``throughput``: training samples per second in the steady state
  (:mod:`lightning_ett.tune.measure`).
* ``ett``: samples trained per hour of the job's wall time — what the ETT% is about, in units
  that also reward speed. A job that trains ``job_hours`` and fails every ``mtbf_hours`` on
  average, with the trial's measured steady throughput ``X``, start-up ``S`` and save cost
  ``C`` (AsyncCheckpoint's measurement: what one save blocked training), saving every ``T``
  seconds of training, fails ``wall / MTBF`` times (failures strike wall time, overhead
  included), each costing a start and half an interval of lost work::

      wall = train + S + train·C/T + (wall / MTBF)·(S + T/2)
           = (train·(1 + C/T) + S) / (1 − (S + T/2) / MTBF)

  (a job whose start and lost half-interval exceed its MTBF never finishes: 0 samples per
  hour). ``T`` is the trial's own interval (``every_n_train_steps`` × its steady step) when it
  saved at a fixed cadence, so the cadence is a knob like any other; with
  ``every_n_train_steps="auto"`` it is Young's interval ``sqrt(2·C·MTBF)``, which "auto"
  converges to; never shorter than one step. The figure is ``X · train / wall`` per hour.

  Not modelled: failure detection and teardown, a restart's checkpoint load, and a faster start
  of later attempts (warm caches): a restart is charged the trial's first start, in full. It is a
  ranking device, not a promise.

The MTBF is stated (``--mtbf-hours``) or read from a previous job's ledger (``--mtbf-from
RUN_DIR``: its wall time over its failures, as AsyncCheckpoint's "auto" cadence estimates it).
"""

from __future__ import annotations

import math
from pathlib import Path

from lightning_ett.checkpoint.cadence import estimate_mtbf_s, young_daly_interval_s
from lightning_ett.tune.measure import Measurement

OBJECTIVES = ("throughput", "ett")


def ett_fraction(m: Measurement, job_hours: float, mtbf_hours: float) -> float | None:
    """Training time ÷ wall time of the modelled job, or ``None`` when the trial lacks a start-up or a save."""
    if m.startup_s is None or m.save_cost_s is None or not m.step_s:
        return None
    train_s, mtbf_s, cost = 3600 * job_hours, 3600 * mtbf_hours, max(m.save_cost_s, 0.0)
    if m.cadence_mode == "fixed" and m.save_interval_steps:
        interval = m.save_interval_steps * m.step_s
    else:
        interval = young_daly_interval_s(cost, mtbf_s)
    interval = min(max(interval, m.step_s), train_s)  # (AsyncCheckpoint saves at most once a step)
    per_failure = m.startup_s + interval / 2
    if per_failure >= mtbf_s:
        return 0.0
    wall = (train_s * (1 + cost / interval) + m.startup_s) / (1 - per_failure / mtbf_s)
    return train_s / wall


def score(m: Measurement, objective: str, job_hours: float | None = None, mtbf_hours: float | None = None) -> float | None:
    """The trial's objective (higher is better), or ``None`` when it cannot be computed (with the trial's reason)."""
    if not m.ok or m.throughput is None:
        return None
    if objective == "throughput":
        return m.throughput
    if job_hours is None or mtbf_hours is None:
        return None
    fraction = ett_fraction(m, job_hours, mtbf_hours)
    if fraction is None:
        return None
    value = 3600 * m.throughput * fraction
    return value if math.isfinite(value) else None


def mtbf_hours_from(run_dir: str | Path) -> tuple[float, str]:
    """A previous job's MTBF from its ETT ledger: ``wall / failures``. A ledger without a failure says only that the
    MTBF is longer than the job ran: a ``ValueError`` asks for ``--mtbf-hours`` instead of guessing."""
    from lightning_ett.instrument.ledger import failed_attempts
    from lightning_ett.instrument.summary import summarize_run_dir

    summary = summarize_run_dir(run_dir)  # (what AsyncCheckpoint's "auto" reads of its own job, for a finished one)
    failures = failed_attempts(run_dir, before=1 << 62)
    if failures == 0:
        raise ValueError(f"its {summary.wall_s / 3600:.3g} h show no failure, so they bound the MTBF from below only; "
                         "give --mtbf-hours")
    mtbf_s, source = estimate_mtbf_s(failures, summary.wall_s)
    return mtbf_s / 3600, f"{source} (the ledger of {run_dir})"
