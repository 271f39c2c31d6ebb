"""Keep the known, non-actionable warnings of the libraries the pack drives off the user's console.

Log warnings: :func:`loggers_at_error` holds the named loggers at ERROR around the block that causes
them (not ``logging.disable``: process-wide, it would hide another thread's warnings too); errors
still show. Python warnings: :func:`hide_upstream_deprecations` filters a few deprecation notices by
their text; should a new version reword one, it shows again: noise, never a lost error.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

_held_lock = threading.Lock()
_held: dict[str, tuple[int, int]] = {}  # logger name -> (blocks holding it now, its level before the first)


@contextmanager
def loggers_at_error(*names: str) -> Iterator[None]:
    """Hold the loggers ``names`` at ERROR inside the block; blocks that overlap (another thread's planning, say)
    restore the level the first one found only when the last one ends."""
    with _held_lock:
        for name in names:
            logger = logging.getLogger(name)
            depth, level = _held.get(name, (0, logger.level))
            _held[name] = (depth + 1, level)
            logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        with _held_lock:
            for name in names:
                depth, level = _held.pop(name)
                if depth > 1:
                    _held[name] = (depth - 1, level)
                else:
                    logging.getLogger(name).setLevel(level)


#: (message, module) of the FutureWarnings raised inside TorchRec's and torch's code on the paths ETTStrategy drives
#: (planning, DMP's DDP wrap, TorchRec's row-wise collectives, its ShardedTensor state dicts at every save), on every
#: rank, none of them about the user's code nor anything the user could change. Both are regular expressions matched
#: at the start (the module: where the warning is attributed). Torch attributes its collectives' notices to its own
#: wrapper (``torch.distributed.c10d_logger``), so those two are hidden for every caller in the process.
UPSTREAM_DEPRECATIONS: tuple[tuple[str, str], ...] = (
    (r"HeuristicalStorageReservation is known to cause issues", r"torchrec\."),  # the planner's default reservation
    (r"`broadcast_buffers` is deprecated", r"torchrec\."),  # the argument DMP passes to DDP
    (r"Please use DTensor instead and we are deprecating ShardedTensor", r"(torch|torchrec|lightning|lightning_ett)\."),
    (r"`torch\.distributed\.reduce_scatter_tensor` is deprecated", r"torch\.distributed\."),  # row-wise, TorchRec's
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", r"torch\.distributed\."),  # comm ops
)


def hide_upstream_deprecations() -> None:
    """Append one ``ignore`` filter per :data:`UPSTREAM_DEPRECATIONS` entry (FutureWarning only), once per process, and
    spend torch's one-time ``is_fx_tracing`` notice quietly.

    Appended, not inserted first: a user's own filters (``-W error::FutureWarning``, pytest's ``filterwarnings``) still
    decide. Why filters and not ``warnings.catch_warnings`` around the calls: that races other threads' filters
    (checkpoint writes run on a background thread) and, on leaving, resets Python's show-once registry, so every
    warning shown before is printed again. Adding a filter resets that registry too: each is added only if absent, so
    only the first ``ETTStrategy()`` of a process does, before a step has run.
    """
    present = {(f[1].pattern, f[3].pattern) for f in warnings.filters if f[1] is not None and f[3] is not None}
    for message, module in UPSTREAM_DEPRECATIONS:
        if (message, module) not in present:
            warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module, append=True)
    # torch logs its ``is_fx_tracing`` deprecation once per process, at TorchRec's first call in a forward: spent here
    # (a user's own later call to that deprecated function then goes unannounced too).
    from torch.fx._symbolic_trace import is_fx_tracing

    with loggers_at_error("torch.fx._symbolic_trace"):
        is_fx_tracing()
