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


def round_order(arms: Sequence[T], r: int) -> list[T]:
    """Round ``r``'s order of the arms: every other round reversed, then rotated by ``r``.

    Rotation alone puts each arm first in turn but always right after the same arm, so a
    carry-over from the arm before (its disk writeback, a launcher still exiting, a warm page
    cache) would stay with one arm; reversing every other round changes who comes before whom.
    """
    base = list(arms) if r % 2 == 0 else list(arms)[::-1]
    k = r % len(base)
    return base[k:] + base[:k]
