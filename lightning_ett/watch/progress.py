"""What each rank is doing and when it last moved, read from the tail of its ETT ledger.

The hang watch runs in ``lightning run``'s agent, beside the workers, and reads only what the
ranks already write: an event when a phase ends and, while a watch reads them, a ``begin`` record
when one starts (:meth:`lightning_ett.instrument.timeline.Timeline.begin`). Watching costs the
training path no collective and no heartbeat thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_ett.instrument.timeline import Phase

TRAIN = Phase.TRAIN.value
SHUTDOWN = Phase.SHUTDOWN.value

class LedgerTail:
    """Reads the records appended to one ledger file since the last read (a torn last line waits for its end)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


@dataclass
class RankProgress:
    """One rank's state as the watch sees it: its phase, its last step and when it last moved."""

    rank: int
    last_progress: float  # the attempt's start until the rank writes its first record
    attempt_start: float = 0.0
    seen: bool = False  # it wrote a record: its job has an ETTMonitor to tell the watch what it does
    pid: int | None = None
    host: str | None = None
    device: str | None = None  # "cuda", "cpu", ...: what its host-side CPU time means (see the hang watch)
    step: int | None = None  # the latest training step it began or finished
    #: How far it got, comparable across ranks: (step, 0 began / 1 finished, phases begun since). Ranks
    #: run the same hooks in the same order, so one that began fewer phases since the same step is behind.
    position: tuple[int, int, int] = (-1, 0, 0)
    trained_steps: int = 0  # in this attempt
    done: bool = False  # it said how its attempt ended (``fit`` is over): what follows is shutdown or post-fit work
    exited: bool = False  # its script ended (the ``shutdown`` event is written at exit): the agent collects it
    _open: list[str] = field(default_factory=list)  # phases begun and not yet ended, innermost last

    @property
    def open_phase(self) -> str | None:
        """The innermost phase it announced and has not ended (a training step is not one: it is the default)."""
        return self._open[-1] if self._open else None

    @property
    def current_step(self) -> int | None:
        """The step it is in, or is about to run (events number steps from 0, as ``global_step`` before each)."""
        step, finished, _ = self.position
        return None if step < 0 else step + finished

    def update(self, record: dict[str, Any]) -> tuple[str, float, int] | None:
        """Apply one ledger record; for a finished phase, returns ``(phase, seconds, training steps before it)``.

        A phase that ended inside another of the same name (a checkpoint load inside Lightning's restore)
        returns ``None``: the outer one is the occurrence.
        """
        self.seen = True
        kind = record.get("kind")
        if kind == "header":
            self.pid, self.host = record.get("pid", self.pid), record.get("host", self.host)
            self.device = record.get("device", self.device)
        elif kind == "begin":
            self._begin(str(record.get("phase")), record.get("step"), float(record.get("time", 0.0)))
        elif kind == "event":
            return self._end(str(record.get("phase")), record.get("step"), float(record.get("start", 0.0)),
                             float(record.get("end", 0.0)))
        elif kind == "status":
            self.done = True
            self._open.clear()  # an attempt that said how it ended has left every phase it was in
            self.last_progress = max(self.last_progress, float(record.get("time", self.last_progress)))
        return None

    def _begin(self, phase: str, step: Any, at: float) -> None:
        if phase == TRAIN:
            self._open.clear()  # a new step began: whatever came before it is over
            self.done = False  # (a second `fit` after the first one ended)
            if isinstance(step, int):
                self.step, self.position = step, (step, 0, 0)
        else:
            self._open.append(phase)
            self.position = (*self.position[:2], self.position[2] + 1)
        self.last_progress = max(self.last_progress, at)

    def _end(self, phase: str, step: Any, start: float, end: float) -> tuple[str, float, int] | None:
        if phase in self._open:
            del self._open[len(self._open) - 1 - self._open[::-1].index(phase)]
        nested = phase in self._open
        steps_before = self.trained_steps
        if phase == TRAIN:
            self.trained_steps += 1
            if isinstance(step, int):
                self.step, self.position = step, (step, 1, 0)
        elif phase == SHUTDOWN:
            self.done = self.exited = True
        self.last_progress = max(self.last_progress, end)
        return None if nested else (phase, end - start, steps_before)
