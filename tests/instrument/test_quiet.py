"""What the pack keeps off the console: named upstream notices only, and nothing else."""

from __future__ import annotations

import logging
import warnings

import pytest

from lightning_ett.instrument.quiet import hide_upstream_deprecations, loggers_at_error


def upstream(message: str, module: str, category: type[Warning] = FutureWarning) -> None:
    """A warning as if raised in ``module`` (where Python attributes it, which the filters match)."""
    warnings.warn_explicit(message, category, f"/site-packages/{module.replace('.', '/')}.py", 1, module=module,
                           registry={})


def test_only_the_named_upstream_deprecations_are_hidden():
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()  # no filter but ours: Python's default action shows each (a fresh registry per call)
        hide_upstream_deprecations()
        upstream("Please use DTensor instead and we are deprecating ShardedTensor.", "torch.overrides")
        upstream("Please use DTensor instead and we are deprecating ShardedTensor.", "lightning_ett.checkpoint.staging")
        upstream("HeuristicalStorageReservation is known to cause issues, ...", "torchrec.distributed.planner.planners")
        upstream("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead.", "torchrec.distributed.model_parallel")
        upstream("`torch.distributed.all_gather_into_tensor` is deprecated. ...", "torch.distributed.c10d_logger")
        upstream("`torch.distributed.reduce_scatter_tensor` is deprecated. ...", "torch.distributed.c10d_logger")
        upstream("Please use DTensor instead and we are deprecating ShardedTensor.", "lightning.fabric.utilities.apply_func")
        shown = [  # each of these is shown:
            ("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead.", "my_model", FutureWarning),  # yours
            ("Please use DTensor instead and we are deprecating ShardedTensor.", "my_model", FutureWarning),
            ("Please use DTensor instead and we are deprecating ShardedTensor.", "torch.overrides", RuntimeWarning),
            ("`foo` is deprecated, use `bar`", "torchrec.modules.utils", FutureWarning),  # another notice
        ]
        for message, module, category in shown:
            upstream(message, module, category)
    assert [(str(w.message), w.category) for w in caught] == [(m, c) for m, _, c in shown]


def test_a_users_own_filters_still_decide_and_a_second_strategy_resets_no_show_once_registry():
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("error", FutureWarning)  # -W error::FutureWarning: the user wants them raised
        warnings.simplefilter("default", UserWarning)
        hide_upstream_deprecations()
        with pytest.raises(FutureWarning):
            upstream("`broadcast_buffers` is deprecated.", "torchrec.distributed.model_parallel")

        def notice() -> None:
            warnings.warn("shown once", UserWarning, stacklevel=1)  # one location: "default" shows it once

        notice()
        hide_upstream_deprecations()  # the filters are there: none added, so the registry is not reset
        notice()
    assert [str(w.message) for w in caught] == ["shown once"]


def test_loggers_held_at_error_still_show_errors_and_get_their_level_back(caplog):
    log = logging.getLogger("lightning_ett.test_quiet")
    log.setLevel(logging.INFO)
    with caplog.at_level(logging.DEBUG), loggers_at_error("lightning_ett.test_quiet"):
        log.warning("a notice")
        log.error("an error")
    assert [r.getMessage() for r in caplog.records if r.name == log.name] == ["an error"]
    assert log.level == logging.INFO


def test_overlapping_blocks_on_one_logger_restore_its_level_when_the_last_ends():
    """Two threads' blocks that overlap (A enters, B enters, A leaves, B leaves) leave the logger as they found it."""
    log = logging.getLogger("lightning_ett.test_quiet_overlap")
    log.setLevel(logging.WARNING)
    a, b = loggers_at_error(log.name), loggers_at_error(log.name)
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert log.level == logging.ERROR  # B's block is still on
    b.__exit__(None, None, None)
    assert log.level == logging.WARNING
