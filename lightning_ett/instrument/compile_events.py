"""torch.compile events from Dynamo's own compile callbacks: the ``compile`` phase and recompile counts.

Why callbacks rather than Dynamo's ``counters``: the callbacks carry a compile id
``<frame>/<n>`` per compilation — ``n > 0`` is exactly a recompile of that frame — and fire at
the start and end of each one, which is what the ETT timeline needs. Backward graphs that
AOTAutograd compiles lazily on the first backward are reported too (``LAZY_BACKWARD``).
Graph breaks are read from Dynamo's counters (the callbacks do not see them).
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from lightning_ett.instrument.timeline import Phase, get_timeline

_COMPILE_ID = re.compile(r"(\d+)/(\d+)")


@dataclass
class CompileTracker:
    """Process-wide tallies (every compiled module in this process feeds them)."""

    compiles: int = 0
    recompiles: int = 0
    seconds: float = 0.0
    compiles_per_frame: Counter[int] = field(default_factory=Counter)
    _open: dict[tuple[str, str], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def on_start(self, args: object) -> None:
        with self._lock:
            self._open[_key(args)] = time.time()
        get_timeline().begin(Phase.COMPILE)  # a long compile is not a hung step

    def on_end(self, args: object) -> None:
        end = time.time()
        with self._lock:
            start = self._open.pop(_key(args), None)
            trigger, compile_id = _key(args)
            if trigger == "DYNAMO":
                self.compiles += 1
                if m := _COMPILE_ID.search(compile_id):
                    frame, n = int(m.group(1)), int(m.group(2))
                    self.compiles_per_frame[frame] = max(self.compiles_per_frame[frame], n + 1)
                    self.recompiles += n > 0
            if start is not None:
                self.seconds += end - start
        if start is not None:
            get_timeline().record(Phase.COMPILE, start, end)

    @staticmethod
    def graph_breaks() -> int:
        from torch._dynamo.utils import counters

        return sum(counters["graph_break"].values())


def _key(args: object) -> tuple[str, str]:
    trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
    return trigger, str(getattr(args, "compile_id", ""))


_tracker: CompileTracker | None = None


def compile_tracker() -> CompileTracker:
    """The process's tracker; registers it with Dynamo's callback handler on first use."""
    global _tracker
    if _tracker is None:
        from torch._dynamo.callback import callback_handler

        _tracker = CompileTracker()
        callback_handler.register_start_callback(_tracker.on_start)
        callback_handler.register_end_callback(_tracker.on_end)
    return _tracker
