"""Online statistics of a layer's FP8 SQNR samples and the verdict their confidence bound supports.

Each sampled step gives one SQNR (dB) per layer: the worst of its three GEMMs under the chosen
recipe. The samples are kept as count, sum and sum of squares (float64), so that ranks combine
them with one all-reduce (sums add) and a restarted job carries them on. The verdict uses a
two-sided Student-t interval for the mean at the given confidence (SciPy's ``special.stdtrit``,
the inverse of the t distribution's CDF; ``scipy.special`` imports in a quarter of the time
``scipy.stats`` takes):

* ``safe`` when its lower bound is at least the threshold;
* ``unsafe`` when its upper bound is below it;
* ``undecided`` otherwise, and always with fewer than two samples.

A sample that is +inf (the FP8 GEMM was exact, e.g. an all-zero input) carries no information
about the noise and is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy.special import stdtrit

SAFE, UNSAFE, UNDECIDED = "safe", "unsafe", "undecided"


@dataclass
class RunningStats:
    count: float = 0.0
    total: float = 0.0
    total_sq: float = 0.0

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.count += 1
            self.total += value
            self.total_sq += value * value

    def merge(self, other: RunningStats) -> RunningStats:
        return RunningStats(self.count + other.count, self.total + other.total, self.total_sq + other.total_sq)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    @property
    def variance(self) -> float:
        """Unbiased sample variance (``nan`` below two samples)."""
        if self.count < 2:
            return math.nan
        return max(self.total_sq - self.total * self.total / self.count, 0.0) / (self.count - 1)

    def bounds(self, confidence: float) -> tuple[float, float]:
        """The two-sided ``confidence`` interval of the mean; (-inf, inf) below two samples."""
        if self.count < 2:
            return -math.inf, math.inf
        half = float(stdtrit(self.count - 1, (1 + confidence) / 2)) * math.sqrt(self.variance / self.count)
        return self.mean - half, self.mean + half

    def verdict(self, threshold_db: float, confidence: float) -> str:
        low, high = self.bounds(confidence)
        if low >= threshold_db:
            return SAFE
        if high < threshold_db:
            return UNSAFE
        return UNDECIDED

    def to_list(self) -> list[float]:
        return [self.count, self.total, self.total_sq]

    @classmethod
    def from_list(cls, values: list[float]) -> RunningStats:
        count, total, total_sq = (float(v) for v in values)
        return cls(count, total, total_sq)
