"""The checkpoint cadence in words, from a ``checkpoint_cadence`` fact (``CadenceDecision.to_fields``).

One wording for AsyncCheckpoint's log line and the ETT report. A failure cost is predicted only
from evidence: failures in the job's ledger, or an MTBF the user gave. Before the first failure
the MTBF is an assumption (``age / 3``: what "auto" plans with, see
:func:`lightning_ett.checkpoint.cadence.estimate_mtbf_s`), and a "predicted overhead" computed
from it says more about the job's age than about its checkpoints: a healthy 3-minute job came
out at 30-48 %. So then the line states the save's own cost and that no failure was seen.
"""

from __future__ import annotations

from typing import Any

#: In an MTBF source: the MTBF is not observed but assumed (no failure yet, or the job's age unknown).
ASSUMED = "assumed"


def mtbf_is_assumed(fields: dict[str, Any]) -> bool:
    return ASSUMED in str(fields.get("mtbf_source", "")) or "age/3" in str(fields.get("mtbf_source", ""))


def cadence_line(fields: dict[str, Any]) -> str:
    """``every N steps (~T s, how); a save blocks training C s (x % of the interval); <failure cost or why none>``."""
    interval_s, cost_s = float(fields["interval_s"]), float(fields["save_cost_s"])
    mtbf = f"MTBF {float(fields['mtbf_s']) / 3600:.3g}h [{fields['mtbf_source']}]"
    how = f"auto: sqrt(2 x save cost x {mtbf})" if fields.get("mode") == "auto" else "fixed"
    share = f" ({100 * cost_s / interval_s:.2f}% of the interval)" if interval_s > 0 else ""
    line = f"every {fields['interval_steps']} steps (~{interval_s:.1f}s, {how}); a save blocks training {cost_s:.3f}s{share}"
    if mtbf_is_assumed(fields):
        return line + "; no failure seen yet, so no cost of failures is predicted"
    via = "" if fields.get("mode") == "auto" else f" at {mtbf}"
    return (line + f"; a failure{via} loses ~{float(fields['expected_loss_per_failure_s']):.1f}s of work on average: "
            f"saves and lost work {100 * float(fields['predicted_overhead']):.2f}% of training time")
