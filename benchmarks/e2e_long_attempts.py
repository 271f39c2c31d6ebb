"""Per attempt of each arm of an ``e2e_ett.py --job long --keep DIR`` run: trained steps and ms a step (rank 0),
the collection before the first step (ETTStrategy's ``gc_freeze`` fact), the pack's ``"auto"`` intervals, and its
restart gaps (the launcher's failure record -> the next attempt's first step).

    .venv/bin/python benchmarks/e2e_long_attempts.py DIR LOG     # LOG: that run's printed output (the rounds' order)

Reads the ledgers with the package's own reader (``read_ledger``, ``read_launcher_records``).
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.e2e_ett import LONG_ARMS
from lightning_ett.instrument.ledger import RankLedger, read_launcher_records, read_ledger


def _attempt(ledger: RankLedger) -> tuple[int, float, float | None, list[int], float | None]:
    """(steps trained, ms a step, the first step's start, the 'auto' intervals decided, the collection's seconds)."""
    train = [e for e in ledger.events if e["phase"] == "train"]
    steps = sum(1 for e in train if "step" in e)
    ms = 1000 * sum(e["end"] - e["start"] for e in train) / max(1, steps)
    first = min((e["start"] for e in train), default=None)
    intervals = [f["interval_steps"] for f in ledger.facts if f.get("name") == "checkpoint_cadence" and f.get("interval_steps")]
    collected = next((f["seconds"] for f in ledger.facts if f.get("name") == "gc_freeze"), None)
    return steps, ms, first, intervals, collected


def main() -> None:
    keep, log = Path(sys.argv[1]), Path(sys.argv[2]).read_text()
    orders = {int(m.group(1)): [a.strip() for a in m.group(2).split("->")]
              for m in re.finditer(r"round (\d+) \(([^)]*)\)", log)}
    # The units' directories are numbered by their place in e2e_ett.long_units' list (filtered by --arms), not by a
    # round's order (round_order's first row is that list only for up to 3 arms).
    units = [arm for arm in LONG_ARMS if arm in orders[0]]
    for r, arms in sorted(orders.items()):
        for arm in arms:
            run = keep / f"r{r}" / f"u{units.index(arm)}" / "job" / "run"
            parts, intervals, first_step = [], [], {}
            for ledger in read_ledger(run, ranks={0}):
                attempt = ledger.attempt
                steps, ms, first, decided, collected = _attempt(ledger)
                parts.append(f"{steps} steps {ms:.1f} ms" + (f" (collection {collected:.2f} s)" if collected else ""))
                intervals += decided
                if first is not None:
                    first_step[attempt] = first
            line = f"r{r} {arm}: " + "; ".join(parts)
            if intervals:
                line += (f" | 'auto' interval steps: median {statistics.median(intervals):g} (min {min(intervals)}, "
                         f"max {max(intervals)}, {len(intervals)} decisions)")
            print(line)
            if arm == "pack":
                failed = {r["attempt"]: r["time"] for r in read_launcher_records(run)
                          if r.get("kind") == "failure" and r.get("root_cause")}
                gaps = [first_step[a + 1] - t for a, t in sorted(failed.items()) if a + 1 in first_step]
                print(f"r{r} pack restart gaps (failure recorded -> first train step of the next attempt): "
                      + ", ".join(f"{g:.2f} s" for g in gaps))


if __name__ == "__main__":
    main()
