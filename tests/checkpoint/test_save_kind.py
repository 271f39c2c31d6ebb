"""An incremental chain goes full while deltas cost about as much as full saves, and tries a delta again later."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

from lightning_ett.checkpoint.save_kind import DELTA_COST_RATIO, MAX_FULL_RUN, SaveKindChooser


def kinds_chosen(chooser: SaveKindChooser, full_s: float, delta_s: float, saves: int, noise: float = 0.0,
                 seed: int = 0) -> list[str]:
    """What ``chooser`` picks over ``saves`` saves (the first full: no base yet) when each kind costs what it is given."""
    rng = random.Random(seed)
    kinds = []
    for i in range(saves):
        kind = "full" if i == 0 or not chooser.delta_pays() else "delta"
        cost = (delta_s if kind == "delta" else full_s) * (1 + rng.uniform(-noise, noise))
        chooser.observe(kind == "delta", cost)
        kinds.append(kind)
    return kinds


def test_deltas_that_cost_a_fraction_of_a_full_save_are_never_interrupted_even_with_noisy_costs():
    for seed in range(20):  # the Zipf stream's costs (0.75 s vs 4.1 s), each reading off by up to 40 %
        assert kinds_chosen(SaveKindChooser(), 4.1, 0.75, 60, noise=0.4, seed=seed) == ["full"] + ["delta"] * 59
    # just under the ratio, exactly measured: still deltas
    assert kinds_chosen(SaveKindChooser(), 4.0, 4.0 * DELTA_COST_RATIO * 0.99, 20) == ["full"] + ["delta"] * 19


def test_deltas_that_cost_as_much_as_a_full_save_give_way_to_full_saves_and_are_tried_again_ever_more_rarely():
    kinds = kinds_chosen(SaveKindChooser(), 3.9, 4.7, 60)  # the uniform stream's costs
    probes = [i for i, kind in enumerate(kinds) if kind == "delta"]
    gaps = [b - a - 1 for a, b in itertools.pairwise(probes)]
    # two losing deltas in a row (one reading is no verdict), then probes after 2, 4, 8, 16 full saves
    assert probes[:2] == [1, 2] and gaps[1:5] == [2, 4, 8, 16] and set(gaps[5:]) == {MAX_FULL_RUN}
    assert kinds.count("delta") == len(probes) <= 9  # of 60 saves


def test_one_costly_delta_among_cheap_ones_changes_nothing():
    chooser = SaveKindChooser()
    chooser.observe(False, 4.0)
    for cost in (0.8, 0.9, 5.0, 0.8, 0.7, 6.0, 0.9):  # a straggler's or a pause's reading now and then
        assert chooser.observe(True, cost) is None and chooser.delta_pays()


def test_once_deltas_pay_again_the_chain_continues():
    chooser = SaveKindChooser()
    kinds = kinds_chosen(chooser, 4.0, 4.5, 9)  # full, 2 deltas (lose), full x2, delta (loses), full x4
    assert kinds == ["full", "delta", "delta", "full", "full", "delta", "full", "full", "full"]
    kinds += kinds_chosen(chooser, 4.0, 1.0, 12)  # deltas got cheaper (its first save is full: the fourth)
    assert kinds[9:] == ["full"] + ["delta"] * 11  # a probe that pays: deltas again, and no more full saves


def test_what_the_costs_said_survives_a_restart():
    chooser = SaveKindChooser()
    kinds_chosen(chooser, 3.9, 4.7, 3)  # full, two losing deltas
    restored = SaveKindChooser()
    restored.load_state_dict(chooser.state_dict())
    assert not restored.delta_pays() and restored.full_cost_s == chooser.full_cost_s
    assert kinds_chosen(restored, 3.9, 4.7, 4)[1:] == ["full", "delta", "full"]  # the 2 full saves, a probe, 4 more


def test_asynccheckpoint_asks_the_costs_before_a_delta_and_full_every_n_saves_overrides_them(tmp_path):
    from lightning_ett import AsyncCheckpoint

    trainer = SimpleNamespace(world_size=2, is_global_zero=True)
    for full_every, expected in ((None, [False, False, True]), (5, [True, True, True])):
        checkpoint = AsyncCheckpoint(tmp_path, every_n_train_steps=1, incremental=True, full_every_n_saves=full_every)
        checkpoint._stager = SimpleNamespace(has_base=True)
        checkpoint._full_bytes = 8 << 30  # a chain far from its restore bound
        checkpoint._kinds.observe(False, 3.9)
        checkpoint._kinds.observe(True, 4.7)
        checkpoint._kinds.observe(True, 4.6)
        due = []
        for _ in range(3):
            due.append(checkpoint._delta_due(trainer))
            if not due[-1]:
                checkpoint._kinds.observe(False, 3.9)
        assert due == expected


def test_a_first_delta_whose_rows_alone_outgrow_the_restore_bound_backs_off_without_counting_as_a_full_cost():
    chooser = SaveKindChooser()
    chooser.observe(False, 4.0)
    said = chooser.observe(False, 9.0, outgrew_bound=True)  # a full save's write plus a comparison for nothing
    assert said is not None and "next 2 saves are full" in said
    assert not chooser.delta_pays() and chooser.full_cost_s == 4.0
    assert kinds_chosen(chooser, 4.0, 1.0, 4)[1:] == ["full", "delta", "delta"]  # 2 full saves, then a delta that pays


def test_asynccheckpoint_backs_off_only_when_the_first_delta_of_a_chain_outgrows_the_bound(tmp_path):
    """A delta written full at a chain's end is the chain's natural end; written full at its start, deltas lost."""
    from lightning_ett import AsyncCheckpoint
    from lightning_ett.checkpoint.writer import WriteResult

    gib = 1 << 30
    trainer = SimpleNamespace(world_size=2, is_global_zero=True, loggers=[], global_step=1)
    checkpoint = AsyncCheckpoint(tmp_path, every_n_train_steps=1, incremental=True)
    checkpoint._stager = SimpleNamespace(has_base=True, nbytes=0)

    def committed(incremental: bool, over_budget: bool = False) -> None:
        blocked = 0.1 if incremental else 1.0  # what each save cost training: deltas pay
        checkpoint._report(trainer, WriteResult(1, tmp_path, 1.0, 2 * gib, blocked, incremental=incremental,
                                                delta_bytes=40 << 20 if incremental else 0, over_budget=over_budget))

    committed(False)
    committed(True)
    committed(False, over_budget=True)  # the chain's next delta did not fit: a new chain starts, deltas go on
    assert checkpoint._kinds.delta_pays() and checkpoint._delta_due(trainer)
    committed(False, over_budget=True)  # the first delta of that chain alone did not fit
    assert not checkpoint._kinds.delta_pays() and not checkpoint._delta_due(trainer)


def test_the_last_save_of_a_fit_is_no_measure_of_what_its_kind_costs(tmp_path):
    """No step runs after it, so its cost reads as its blocked time alone (a full save at 0.006 s, seen by a user)."""
    from lightning_ett import AsyncCheckpoint
    from lightning_ett.checkpoint.writer import WriteResult

    trainer = SimpleNamespace(world_size=2, is_global_zero=True, loggers=[], global_step=9)
    checkpoint = AsyncCheckpoint(tmp_path, every_n_train_steps=1, incremental=True)
    checkpoint._stager = SimpleNamespace(has_base=True, nbytes=0)
    checkpoint._report(trainer, WriteResult(3, tmp_path, 1.0, 1 << 30, 2.0))
    checkpoint._final_step = 9
    checkpoint._report(trainer, WriteResult(9, tmp_path, 1.0, 1 << 30, 0.006))
    assert checkpoint._kinds.full_cost_s == 2.0


def test_untypical_full_saves_do_not_set_the_reference_and_the_callback_keeps_the_record_across_a_restart(tmp_path):
    from lightning_ett import AsyncCheckpoint

    chooser = SaveKindChooser()
    chooser.observe(False, 8.0, typical=False)  # a fit's first save: it allocated the staging buffers
    chooser.observe(False, 2.0)
    chooser.observe(False, 9.0, typical=False)  # a delta the writer turned full
    assert chooser.full_cost_s == 2.0
    assert chooser.observe(True, 1.9) is None  # 95 % of a typical full save: one reading is no verdict
    assert chooser.observe(True, 1.8) is not None  # a second: deltas stop

    checkpoint = AsyncCheckpoint(tmp_path, every_n_train_steps=1, incremental=True)
    checkpoint._kinds = chooser
    restored = AsyncCheckpoint(tmp_path, every_n_train_steps=1, incremental=True)
    restored.load_state_dict(checkpoint.state_dict())
    assert restored._kinds.state_dict() == chooser.state_dict() and not restored._kinds.delta_pays()
