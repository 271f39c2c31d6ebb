"""ETTStrategy's gc_freeze (lightning_ett.strategies.gc_freeze) in one process, on CPython's real collector.

The 2-rank fits in tests/distributed/test_input_pipeline.py check it in training (frozen at every batch,
unfrozen by on_train_end and on_exception); these check what a freeze made elsewhere keeps.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from lightning_ett import ETTStrategy
from lightning_ett.durable.errors import ConfigurationError
from lightning_ett.strategies.gc_freeze import StartupObjectsFrozen


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_start_up_garbage_is_collected_before_the_survivors_are_frozen_and_unfrozen_after():
    garbage = Node()
    gone = weakref.ref(garbage)
    del garbage
    frozen = StartupObjectsFrozen()
    frozen.freeze()
    assert gone() is None  # collected before training, not frozen with the living
    assert gc.get_freeze_count() == frozen.frozen > 1000
    frozen.freeze()  # a second start of the same fit (the LR finder runs the fit loop too): nothing more
    frozen.unfreeze()
    assert gc.get_freeze_count() == 0
    frozen.unfreeze()  # idempotent
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_elsewhere_is_left_alone_and_not_undone():
    gc.freeze()  # the program's own (e.g. before forking workers), or an outer fit's
    theirs = gc.get_freeze_count()
    garbage = Node()
    gone = weakref.ref(garbage)
    del garbage
    inner = StartupObjectsFrozen()
    inner.freeze()
    assert gone() is not None  # no collection either: the collector is left as it is
    inner.unfreeze()
    assert gc.get_freeze_count() >= theirs  # still frozen


def test_an_outer_fit_keeps_its_freeze_when_an_inner_fit_ends():
    outer, inner = StartupObjectsFrozen(), StartupObjectsFrozen()
    outer.freeze()
    inner.freeze()
    inner.unfreeze()
    assert gc.get_freeze_count() > 0
    outer.unfreeze()
    assert gc.get_freeze_count() == 0


def test_gc_freeze_must_be_a_bool():
    with pytest.raises(ConfigurationError, match=r"ETTStrategy\(gc_freeze='no'\): expected True or False"):
        ETTStrategy(gc_freeze="no")  # type: ignore[arg-type]
    assert ETTStrategy(gc_freeze=False).gc_freeze is None
