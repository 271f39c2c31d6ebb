"""Marks a strategy makes inside a training step, for the instruments that stamp steps (the straggler diagnosis).

Why: Lightning's hooks cannot see work a strategy does inside ``training_step``. ETTStrategy's
pipeline reads the *next* batch there, before the forward's first collective; a rank slow to read
it arrives late at that collective, which absorbs the lateness, so a stamp taken at
``on_train_batch_start`` (before) or at the backward (after) shows the ranks together. The
strategy says when that data work is done; the diagnosis counts it on the batch's data side.
A plain list of listeners: one mark, a few listeners, a call per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_listeners: list[Callable[[float], None]] = []


def listen_for_data_read(listener: Callable[[float], None]) -> Callable[[], None]:
    """Call ``listener(perf_counter time)`` at every :func:`data_read`; returns what stops it."""
    _listeners.append(listener)

    def stop() -> None:
        if listener in _listeners:
            _listeners.remove(listener)

    return stop


def data_read() -> None:
    """Host-side data work inside the step is done (the next batch read and moved to the device)."""
    if _listeners:
        now = time.perf_counter()
        for listener in _listeners:
            listener(now)
