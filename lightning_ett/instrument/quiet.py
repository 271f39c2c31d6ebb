"""Keep a library's known, non-actionable log warnings off the user's console for one block.

Not ``logging.disable`` (process-wide: it would hide another thread's warnings too) and not a
filter on message text (it breaks silently when the text changes): the named loggers alone are
held at ERROR, and restored after, so errors still show and nothing outside the block changes.
"""

from __future__ import annotations

import logging
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
