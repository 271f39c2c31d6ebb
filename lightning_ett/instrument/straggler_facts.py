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
    in. ``worst``: the rank named most often (of those the live warning named, if any), with the median of its scores when
    named, its side, and ``streak``: the longest streak of the live warning's rule that named it (what the warning
    and the report go by).
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
        streaks = _streaks_by_rank(facts)
        warned = sorted({int(f["straggler"]) for f in facts if f.get("warned") is True and f.get("straggler") is not None})
        if not warned:  # (facts written without the field: the ranks a warning-long streak named)
            warned = [r for r in named if streaks.get(r, 0) >= WARN_AFTER_WINDOWS]
        rank = max(warned or named, key=lambda r: (named[r], streaks.get(r, 0)))
        windows = named[rank]
        mine = [f for f in facts if f.get("straggler") == rank]
        sides = Counter(f.get("side") for f in mine)
        score = statistics.median(float(f["score_s"]) for f in mine)
        digest["worst"] = {"rank": rank, "windows": windows, "score_s": round(score, 6), "side": sides.most_common(1)[0][0],
                           "first_step": mine[0].get("step"), "last_step": mine[-1].get("step"),
                           "streak": streaks.get(rank, 0)}
    return digest


def _streaks_by_rank(facts: list[dict[str, Any]]) -> dict[int, int]:
    """Per named rank, the longest streak of the live warning's rule that named it: the facts' ``streak`` field over
    a run of windows (a slow node's ranks take turns being named, and the rule counts them as one streak: each of them
    gets the run's streak), so the report has its line whenever the warning fired, naming a rank the warning named.
    Facts written without the field count consecutive windows naming the rank."""
    best: dict[int, int] = {}
    named = [f for f in facts if f.get("straggler") is not None]
    if named and all(isinstance(f.get("streak"), int) and not isinstance(f.get("streak"), bool) for f in named):
        run: set[int] = set()
        for fact in facts:
            rank, streak = fact.get("straggler"), fact.get("streak")
            if rank is None or not isinstance(streak, int) or streak < 1:
                run = set()
                continue
            if streak == 1:
                run = set()
            run.add(int(rank))
            for member in run:
                best[member] = max(best.get(member, 0), streak)
        return best
    current: dict[int, int] = {}
    for fact in facts:
        rank = fact.get("straggler")
        current = {int(rank): current.get(int(rank), 0) + 1} if rank is not None else {}
        for member, streak in current.items():
            best[member] = max(best.get(member, 0), streak)
    return best


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
