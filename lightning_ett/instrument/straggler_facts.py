"""The straggler diagnosis as the summary and the report state it, from rank 0's ``straggler`` facts.

Each fact is one window's verdict (written by :mod:`lightning_ett.watch.stragglers` through
``Timeline.fact``): ``step``, ``scores`` (seconds per training batch the other ranks waited for each
rank; a batch is a micro-batch under gradient accumulation),
``straggler`` (a rank or ``None``), ``score_s``, ``side`` (``data`` or ``compute``),
``threshold_s``, ``batches``. Waiting for a straggler is slow training, not lifecycle overhead: it
stays ``train`` time, and this is a diagnosis next to the ETT%, never a phase.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

#: Consecutive windows one rank must be named in before it is called a straggler: the live warning's rule
#: (:mod:`lightning_ett.watch.stragglers`) and the report's. One window alone is often one noisy gather.
WARN_AFTER_WINDOWS = 2


def straggler_digest(facts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``stragglers`` entry of ``ett_summary.json``; ``None`` when no window was scored.

    ``latest``: the last window's per-rank scores and verdict. ``named``: windows each rank was named
    in. ``worst``: the rank named most often, with the median of its scores when named, its side, and
    ``streak``: the longest streak of the live warning's rule (what the warning and the report go by).
    """
    facts = [f for f in facts if _valid(f)]  # a hand-edited or foreign fact is left out, never a crash
    if not facts:
        return None
    latest = facts[-1]
    named = Counter(int(f["straggler"]) for f in facts if f.get("straggler") is not None)
    digest: dict[str, Any] = {
        "windows": len(facts),
        "straggler": latest.get("straggler"),
        "latest": {"step": latest.get("step"), "scores": {str(r): s for r, s in enumerate(latest.get("scores") or [])},
                   "threshold_s": latest.get("threshold_s"), "side": latest.get("side")},
        "named": {str(rank): count for rank, count in sorted(named.items())},
        "worst": None,
    }
    if named:
        rank, windows = named.most_common(1)[0]
        mine = [f for f in facts if f.get("straggler") == rank]
        sides = Counter(f.get("side") for f in mine)
        score = statistics.median(float(f["score_s"]) for f in mine)
        digest["worst"] = {"rank": rank, "windows": windows, "score_s": round(score, 6), "side": sides.most_common(1)[0][0],
                           "first_step": mine[0].get("step"), "last_step": mine[-1].get("step"),
                           "streak": _longest_streak(facts, rank)}
    return digest


def _longest_streak(facts: list[dict[str, Any]], rank: int) -> int:
    """The longest streak of the live warning's rule: the facts' ``streak`` field, whichever rank it ended on (a slow
    node's ranks take turns being named, and the rule counts them as one streak), so the report has its line
    whenever the warning fired. Facts written without it count consecutive windows naming ``rank``, in order."""
    streaks = [f.get("streak") for f in facts if f.get("straggler") is not None]
    if streaks and all(isinstance(s, int) and not isinstance(s, bool) for s in streaks):
        return max(streaks)
    longest = current = 0
    for fact in facts:
        current = current + 1 if fact.get("straggler") == rank else 0
        longest = max(longest, current)
    return longest


def _valid(fact: dict[str, Any]) -> bool:
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    straggler, scores = fact.get("straggler"), fact.get("scores")
    return ((straggler is None or (isinstance(straggler, int) and not isinstance(straggler, bool)))
            and number(fact.get("score_s")) and isinstance(scores, list) and all(number(v) for v in scores))


def straggler_line(digest: dict[str, Any] | None) -> str | None:
    """One line for the report under the table, or ``None`` unless a rank was named in
    ``WARN_AFTER_WINDOWS`` consecutive windows (the live warning's rule)."""
    if not digest or not digest.get("worst") or digest["worst"].get("streak", 0) < WARN_AFTER_WINDOWS:
        return None
    w = digest["worst"]
    return (f"straggler: rank {w['rank']}, others waited {1000 * w['score_s']:.0f} ms/batch ({w['side']} side); "
            f"named in {w['windows']} of {digest['windows']} windows (steps {w['first_step']}..{w['last_step']}); "
            "a diagnosis: the waiting stays in train time")
