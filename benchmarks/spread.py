"""Rounds of a benchmark: the order of the arms in each round, and how a figure measured over rounds is printed."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def median_range(values: list[float], fmt: str = ".2f") -> str:
    """``median (min-max)``; a single value alone."""
    text = format(statistics.median(values), fmt)
    return text + (f" ({min(values):{fmt}}-{max(values):{fmt}})" if len(values) > 1 else "")


def aa_floor(aa: list[float]) -> float:
    """The noise floor: how far the A/A ratios (the baseline against itself, per round) strayed from 1."""
    return max(abs(1 - v) for v in aa)


def against_floor(ratios: list[float], floor: float) -> str:
    """A ratio's median inside the floor is no difference shown, whatever its goal says."""
    return "no difference beyond the A/A floor" if abs(1 - statistics.median(ratios)) <= floor else "a difference"


def round_order(arms: Sequence[T], r: int) -> list[T]:
    """Round ``r``'s order of the arms: row ``r`` of a Williams design (a balanced Latin square).

    Every ``n`` rounds (``2n`` for an odd number of arms) each arm runs in each position once
    and follows each other arm once, so neither a position (the first run on a cooler machine)
    nor a carry-over from the arm before (its disk writeback, a launcher still exiting, a warm
    page cache) stays with one arm. Hand-written because it is six lines; no dependency has it.
    """
    n = len(arms)
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    row = [(i + r) % n for i in first]
    if n % 2 and (r // n) % 2:  # odd n: the mirrored square balances who follows whom
        row.reverse()
    return [arms[i] for i in row]
