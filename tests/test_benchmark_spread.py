"""The benchmarks' arm order (no position and no predecessor stays with one arm) and their A/A verdict."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.spread import aa_floor, against_floor, round_order


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


def test_a_ratio_inside_the_aa_floor_is_no_difference_and_one_beyond_it_is() -> None:
    floor = aa_floor([0.95, 1.08, 1.02])  # the A/A strayed 8 % at most
    assert floor == pytest.approx(0.08)
    assert against_floor([1.07, 1.06, 1.30], floor) == "no difference beyond the A/A floor"  # median 1.07
    assert against_floor([0.90, 0.91, 1.00], floor) == "a difference"  # median 0.91: 9 % below
