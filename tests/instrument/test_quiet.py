"""What the pack keeps off the console: named upstream notices only, and nothing else."""

from __future__ import annotations

import logging
import warnings

from lightning_ett.instrument.quiet import UPSTREAM_DEPRECATIONS, hide_upstream_deprecations, loggers_at_error


def test_only_the_named_upstream_deprecations_are_hidden_and_each_filter_is_added_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        hide_upstream_deprecations()
        filters = list(warnings.filters)
        hide_upstream_deprecations()  # again (a second strategy): no filter added, so the show-once registry stays
        assert warnings.filters == filters
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning, stacklevel=1)
        warnings.warn("HeuristicalStorageReservation is known to cause issues, particularly ...", FutureWarning, stacklevel=1)
        warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead.", FutureWarning, stacklevel=1)
        warnings.warn("`foo` is deprecated, use `bar`", FutureWarning, stacklevel=1)  # anyone else's: shown
        warnings.warn("ShardedTensor shards do not add up", UserWarning, stacklevel=1)  # not a deprecation notice: shown
    assert [str(w.message) for w in caught] == ["`foo` is deprecated, use `bar`", "ShardedTensor shards do not add up"]
    assert len(UPSTREAM_DEPRECATIONS) == 3


def test_loggers_held_at_error_still_show_errors_and_get_their_level_back(caplog):
    log = logging.getLogger("lightning_ett.test_quiet")
    log.setLevel(logging.INFO)
    with caplog.at_level(logging.DEBUG), loggers_at_error("lightning_ett.test_quiet"):
        log.warning("a notice")
        log.error("an error")
    assert [r.getMessage() for r in caplog.records if r.name == log.name] == ["an error"]
    assert log.level == logging.INFO
