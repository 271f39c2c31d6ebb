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


def tracked(obj: object) -> bool:
    """Whether the collector's generations hold ``obj``: a frozen object is in none (its count drops as frozen
    objects die, so where an object is, not the count, says whether it is still frozen)."""
    return any(other is obj for other in gc.get_objects())


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
    assert frozen.frozen >= gc.get_freeze_count() > 1000  # (objects freed by reference counting leave the count)
    frozen.freeze()  # a second start of the same fit (the LR finder runs the fit loop too): nothing more
    frozen.unfreeze()
    assert gc.get_freeze_count() == 0
    frozen.unfreeze()  # idempotent
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_elsewhere_is_left_alone_and_not_undone():
    theirs = Node()
    gc.freeze()  # the program's own (e.g. before forking workers), or an outer fit's
    garbage = Node()
    gone = weakref.ref(garbage)
    del garbage
    inner = StartupObjectsFrozen()
    inner.freeze()
    assert gone() is not None  # no collection either: the collector is left as it is
    inner.unfreeze()
    assert not tracked(theirs)  # still frozen


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


def test_a_fit_loop_run_again_inside_the_fit_neither_collects_again_nor_unfreezes():
    """Lightning's LR finder called from a callback, or BatchSizeFinder's trials, run on_train_start (and
    on_train_end) again inside the fit: one collection per fit, unfrozen at its teardown."""
    frozen = StartupObjectsFrozen()
    frozen.freeze()  # the fit
    garbage, young = Node(), Node()
    gone = weakref.ref(garbage)
    del garbage
    frozen.freeze()  # lr_find's fit loop
    assert gone() is not None  # no second collection
    assert tracked(young)  # no second freeze
    frozen.unfreeze()  # teardown
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_during_the_fit_is_kept():
    frozen = StartupObjectsFrozen()
    frozen.freeze()
    for _ in range(2000):  # start-up objects dying during the fit lower the count: the probe, not the count, decides
        Node().me = None
    theirs = [Node() for _ in range(10)]
    gc.freeze()  # e.g. a callback before its data loader forks workers
    frozen.unfreeze()
    assert gc.get_freeze_count() > 1000  # theirs, and so ours, kept
    assert not tracked(theirs[0])
    del theirs


def test_a_program_that_turned_automatic_collection_off_is_left_alone():
    garbage = Node()
    gone = weakref.ref(garbage)
    del garbage
    gc.disable()
    try:
        frozen = StartupObjectsFrozen()
        frozen.freeze()
        assert gone() is not None and gc.get_freeze_count() == 0  # no collection, nothing frozen
        frozen.unfreeze()
        assert not gc.isenabled()
    finally:
        gc.enable()
