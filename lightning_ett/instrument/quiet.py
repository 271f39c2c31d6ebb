"""Keep the known, non-actionable warnings of the libraries the pack drives off the user's console.

Log warnings: :func:`loggers_at_error` holds the named loggers at ERROR around the block that causes
them (not ``logging.disable``: process-wide, it would hide another thread's warnings too); errors
still show. Python warnings: :func:`hide_upstream_deprecations` filters a few deprecation notices by
their text; should a new version reword one, it shows again: noise, never a lost error.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def loggers_at_error(*names: str) -> Iterator[None]:
    """Hold the loggers ``names`` at ERROR inside the block."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


#: Deprecation notices raised inside TorchRec's and torch's own code on the paths ETTStrategy drives (planning, DMP's
#: DDP wrap, TorchRec's ShardedTensor state dicts at every save), once per rank, none of them about the user's code nor
#: anything the user could change: TorchRec's default storage reservation, the ``broadcast_buffers`` argument TorchRec
#: passes to DDP, and TorchRec's ShardedTensor (its state-dict format).
UPSTREAM_DEPRECATIONS = (
    r"HeuristicalStorageReservation is known to cause issues",
    r"`broadcast_buffers` is deprecated",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
)


def hide_upstream_deprecations() -> None:
    """Add one ``ignore`` filter per :data:`UPSTREAM_DEPRECATIONS` message, once per process, and spend torch's
    one-time ``is_fx_tracing`` notice quietly.

    Why filters and not ``warnings.catch_warnings`` around the calls: that races other threads' filters (checkpoint
    writes run on a background thread) and, on leaving, resets Python's show-once registry, so every warning shown
    before is printed again. Adding a filter resets it too, so each is added only if absent (the strategy's
    constructor calls this, before a step has run).
    """
    present = {f[1].pattern for f in warnings.filters if f[1] is not None}
    for message in UPSTREAM_DEPRECATIONS:
        if message not in present:
            warnings.filterwarnings("ignore", message=message)
    # torch logs its ``is_fx_tracing`` deprecation once per process, at TorchRec's first call in a forward: spent here
    from torch.fx._symbolic_trace import is_fx_tracing

    with loggers_at_error("torch.fx._symbolic_trace"):
        is_fx_tracing()
