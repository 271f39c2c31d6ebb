"""The benchmarks' arm order: no position and no predecessor stays with one arm."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.spread import round_order


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_round_order_is_a_balanced_latin_square(n: int) -> None:
    arms = [f"arm{i}" for i in range(n)]
    rounds = n if n % 2 == 0 else 2 * n
    rows = [round_order(arms, r) for r in range(rounds)]
    assert all(sorted(row) == arms for row in rows)
    positions = Counter((arm, i) for row in rows for i, arm in enumerate(row))
    predecessors = Counter((row[i - 1], row[i]) for row in rows for i in range(1, n))
    assert len(positions) == n * n and len(set(positions.values())) == 1  # each arm in each position equally often
    assert len(predecessors) == n * (n - 1) and len(set(predecessors.values())) == 1  # each ordered pair equally often


def test_two_arms_alternate() -> None:
    assert [round_order(["a", "b"], r) for r in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
