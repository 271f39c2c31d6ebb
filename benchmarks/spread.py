"""How the benchmarks print a figure measured over rounds: the median, and the range when there is one."""

from __future__ import annotations

import statistics


def median_range(values: list[float], fmt: str = ".2f") -> str:
    """``median (min-max)``; a single value alone."""
    text = format(statistics.median(values), fmt)
    return text + (f" ({min(values):{fmt}}-{max(values):{fmt}})" if len(values) > 1 else "")
