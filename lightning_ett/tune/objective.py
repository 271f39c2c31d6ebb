"""What a trial is worth: its training throughput, or the ETT% the whole job would reach with its costs.

``ett`` uses AsyncCheckpoint's ``"auto"`` cost model (:mod:`lightning_ett.checkpoint.cadence`)
for a job that trains ``job_hours`` and fails every ``mtbf_hours`` on average:

* it checkpoints at Young's interval ``T = sqrt(2·C·MTBF)``, ``C`` the trial's measured save cost,
  which costs ``C/T + T/(2·MTBF)`` of the training time (saves, and work lost per failure);
* it starts once, and again after each of its ``job_hours / mtbf_hours`` failures, each start
  costing the trial's measured start-up (a restart is taken to cost a first start: no warm
  compile or plan cache assumed, which makes configurations with long start-ups pay in full);
* ETT% = training time / (training time + starts + saves + lost work).

Not modelled: failure detection and teardown, a restart's checkpoint load, and a slower start
of later attempts; the figure is a ranking device, not a promise.
"""

from __future__ import annotations

import math

from lightning_ett.checkpoint.cadence import young_daly_interval_s
from lightning_ett.tune.measure import Measurement

OBJECTIVES = ("throughput", "ett")


def ett_percent(startup_s: float, save_cost_s: float, job_hours: float, mtbf_hours: float) -> float:
    train_s, mtbf_s = 3600 * job_hours, 3600 * mtbf_hours
    starts = 1 + train_s / mtbf_s
    if save_cost_s > 0:
        interval = min(young_daly_interval_s(save_cost_s, mtbf_s), train_s)
        per_train_s = save_cost_s / interval + interval / (2 * mtbf_s)
    else:
        per_train_s = 0.0
    wall = train_s + starts * startup_s + train_s * per_train_s
    return 100 * train_s / wall


def score(m: Measurement, objective: str, job_hours: float | None = None, mtbf_hours: float | None = None) -> float | None:
    """The trial's objective (higher is better), or ``None`` when it cannot be computed (with the trial's reason)."""
    if not m.ok:
        return None
    if objective == "throughput":
        return m.throughput
    if m.startup_s is None or m.save_cost_s is None or job_hours is None or mtbf_hours is None:
        return None
    value = ett_percent(m.startup_s, m.save_cost_s, job_hours, mtbf_hours)
    return value if math.isfinite(value) else None
