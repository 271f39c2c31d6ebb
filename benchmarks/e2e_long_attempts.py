"""Per attempt of each arm of an ``e2e_ett.py --job long --keep DIR`` run: trained steps and ms a step (rank 0),
the collection before the first step (ETTStrategy's ``gc_freeze`` fact), the pack's ``"auto"`` intervals, and its
restart gaps (the launcher's failure record -> the next attempt's first step).

    python benchmarks/e2e_long_attempts.py DIR LOG     # LOG: that run's printed output (the rounds' arm order)
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

LONG_UNITS = ("vanilla", "same-training", "pack", "same-training A/A")  # e2e_ett.long_units' order


def _records(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _attempt(ledger: Path) -> tuple[int, float, float | None, list[int], float | None]:
    """(steps trained, ms a step, the first step's start, the 'auto' intervals decided, the collection's seconds)
    from rank 0's ledger."""
    records = _records(ledger)
    train = [r for r in records if r.get("kind") == "event" and r.get("phase") == "train"]
    steps = sum(1 for r in train if "step" in r)
    ms = 1000 * sum(r["end"] - r["start"] for r in train) / max(1, steps)
    first = min((r["start"] for r in train), default=None)
    intervals = [r["interval_steps"] for r in records if r.get("name") == "checkpoint_cadence" and r.get("interval_steps")]
    collected = next((r["seconds"] for r in records if r.get("name") == "gc_freeze"), None)
    return steps, ms, first, intervals, collected


def main() -> None:
    keep, log = Path(sys.argv[1]), Path(sys.argv[2]).read_text()
    orders = {int(m.group(1)): [a.strip() for a in m.group(2).split("->")]
              for m in re.finditer(r"round (\d+) \(([^)]*)\)", log)}
    # The units' directories are numbered by their place in e2e_ett.long_units' list (filtered by --arms), not by a
    # round's order (round_order's first row is that list only for up to 3 arms).
    units = [arm for arm in LONG_UNITS if arm in orders[0]]
    for r, arms in sorted(orders.items()):
        for arm in arms:
            run = keep / f"r{r}" / f"u{units.index(arm)}" / "job" / "run" / "ledger"
            parts, intervals, first_step = [], [], {}
            for attempt_dir in sorted(run.glob("attempt-*")):
                attempt = int(attempt_dir.name.split("-")[1])
                steps, ms, first, decided, collected = _attempt(attempt_dir / "rank-00000.jsonl")
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
                failed = {r["attempt"]: r["time"] for r in _records(run / "launcher" / "node-00000.jsonl")
                          if r.get("kind") == "failure" and r.get("root_cause")}
                gaps = [first_step[a + 1] - t for a, t in sorted(failed.items()) if a + 1 in first_step]
                print(f"r{r} pack restart gaps (failure recorded -> first train step of the next attempt): "
                      + ", ".join(f"{g:.2f} s" for g in gaps))


if __name__ == "__main__":
    main()
