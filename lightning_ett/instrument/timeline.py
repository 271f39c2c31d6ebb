"""Phase events: what every component reports, and the process-wide recorder.

Components say only "phase X ran from t0 to t1" through :func:`record_phase` (a context
manager and decorator) or :meth:`Timeline.record`. The timeline knows nothing of Lightning,
TorchRec or W&B: it appends events to this rank's ledger once :meth:`Timeline.bind` names
it, and keeps events recorded before that in memory until then.

Events may nest (a checkpoint save inside a training-step interval); the innermost one owns
the time it covers. The running per-phase totals here apply that rule incrementally, so
the live ETT% costs O(1) per event instead of a pass over the ledger.
"""

from __future__ import annotations

import atexit
import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from typing_extensions import Self

from lightning_ett.instrument.ledger import LedgerWriter, ledger_path


class Phase(str, Enum):
    """Where wall time goes. Only ``train`` is effective; everything else is overhead."""

    LAUNCH = "launch"
    IMPORT = "import"
    TRAINER_INIT = "trainer_init"
    LIGHTNING_LAUNCHER = "lightning_launcher"
    PROCESS_GROUP_INIT = "process_group_init"
    LOGGER_INIT = "logger_init"
    MODEL_INIT = "model_init"
    SHARDING_PLAN = "sharding_plan"
    DATA_INIT = "data_init"
    COMPILE = "compile"
    CHECKPOINT_LOAD = "checkpoint_load"
    TRAIN = "train"
    CHECKPOINT_SAVE = "checkpoint_save"
    EVAL = "eval"
    PUBLISH = "publish"
    REPEATED = "repeated"
    HANG = "hang"
    NODE_LOST = "node_lost"  # a node stopped responding: from its last heartbeat to the restart with it (launcher)
    SHUTDOWN = "shutdown"
    OTHER = "other"

    @classmethod
    def parse(cls, value: str | Phase) -> Phase:
        if isinstance(value, Phase):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ValueError(f"Unknown ETT phase {value!r}; expected one of: {names}.") from None


#: Derived by the summary, never recorded: earlier copies of steps a later attempt re-ran.
LOST = "lost"
PHASE_NAMES: tuple[str, ...] = tuple(p.value for p in Phase) + (LOST,)

#: Names of the facts (:meth:`Timeline.fact`) the report states in words.
CADENCE_FACT = "checkpoint_cadence"  # AsyncCheckpoint's interval and what it came from
CHECKPOINT_FACT = "checkpoint"  # a checkpoint AsyncCheckpoint made durable: its step, path, whether a delta (rank 0)
PUBLISH_FACT = "publish"  # a version ModelPublisher published
PUBLISH_ERROR_FACT = "publish_error"  # a publish that failed
STRAGGLER_FACT = "straggler"  # one window of the straggler diagnosis (lightning_ett.watch.stragglers)
BATCH_FACT = "batch"  # ETTMonitor: samples in this rank's first training batch of the attempt (throughput's unit)
FP8_FACT = "fp8_probe"  # FP8Probe's verdict: how many layers (and GEMM FLOPs) can run in FP8 (rank 0, end of fit)
GC_FREEZE_FACT = "gc_freeze"  # ETTStrategy froze start-up's objects: how many, and the collection before it (every rank)
SPARSE_2D_FACT = "sparse_2d"  # ETTStrategy's 2D layout and what its replica syncs cost (rank 0, at the end of fit)


@dataclass(frozen=True)
class Event:
    phase: str
    start: float
    end: float
    rank: int
    attempt: int
    step: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"kind": "event", "phase": self.phase, "start": self.start, "end": self.end,
                                  "rank": self.rank, "attempt": self.attempt}
        if self.step is not None:
            record["step"] = self.step
        return record


class Timeline:
    """Process-wide recorder of phase events for one rank of one attempt."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writer: LedgerWriter | None = None
        self._pending: list[Event] = []
        self._open_intervals: list[tuple[float, float, str]] = []  # recent top-level (start, end, phase)
        self.exclusive_s: dict[str, float] = {}
        self.rank = 0
        self.attempt = 0
        self.run_dir: Path | None = None
        #: When set, process exit records ``shutdown`` from this time (see :func:`_finish_at_exit`).
        self.shutdown_from: float | None = None
        #: Whether the ``import`` phase of this process was recorded (once per process).
        self.import_recorded = False
        #: Whether :meth:`begin` writes: set when a hang watch reads this ledger (``lightning run``).
        self.announce = False
        #: Events recorded so far: a step in which this grew by more than its own event had others nested in it.
        self.recorded = 0

    def bind(self, run_dir: Path, rank: int, attempt: int, header: dict[str, Any]) -> Path:
        """Start writing this rank's ledger; flush events recorded before the bind."""
        path = ledger_path(run_dir, attempt, rank)
        with self._lock:
            if self._writer is not None and self._writer.path == path:
                return path
            writer = LedgerWriter(path)  # raises with the path named if it is not writable
            if self._writer is not None:
                self._writer.close()
            self._writer, self.run_dir, self.rank, self.attempt = writer, Path(run_dir), rank, attempt
            host = socket.gethostname()
            writer.append({"kind": "header", "rank": rank, "attempt": attempt, "pid": os.getpid(), "host": host, **header})
            pending, self._pending = self._pending, []
            for event in pending:
                writer.append(replace(event, rank=rank, attempt=attempt).to_record())
        return path

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def record(self, phase: str | Phase, start: float, end: float, step: int | None = None) -> Event:
        """Record that ``phase`` ran from ``start`` to ``end`` (``time.time()`` seconds)."""
        name = Phase.parse(phase).value
        if end < start:
            raise ValueError(f"Event {name!r} ends before it starts ({end} < {start}).")
        event = Event(name, start, end, self.rank, self.attempt, step)
        with self._lock:
            self._account(event)
            self.recorded += 1
            if self._writer is None:
                self._pending.append(event)
            else:
                self._writer.append(event.to_record())
        return event

    def _account(self, event: Event) -> None:
        # Events are usually recorded when they end, so every earlier top-level interval that
        # starts inside this one is nested in it: it owns that time, not this event. An event
        # recorded after the interval that contains it (a part of a step found out afterwards,
        # such as the slowdown a background checkpoint write caused) takes its time from it.
        nested = 0.0
        intervals = self._open_intervals
        while intervals and intervals[-1][0] >= event.start:
            s, e, _ = intervals.pop()
            nested += min(e, event.end) - s
        if intervals and intervals[-1][0] <= event.start and event.end <= intervals[-1][1]:
            outer = intervals[-1][2]
            self.exclusive_s[outer] = max(self.exclusive_s.get(outer, 0.0) - event.duration, 0.0)
        else:
            intervals.append((event.start, event.end, event.phase))
            if len(intervals) > 4096:
                del intervals[:2048]
        self.exclusive_s[event.phase] = self.exclusive_s.get(event.phase, 0.0) + max(event.duration - nested, 0.0)

    def carve(self, phase: str | Phase, seconds: float, within: str | Phase, step: int | None = None) -> Event | None:
        """Give the last ``seconds`` of the latest top-level event to ``phase``, if that event is a ``within``.

        For time found out only after its interval ended: the part of a training step that a
        background checkpoint write cost. Returns ``None`` when there is no such event.
        """
        with self._lock:
            last = self._open_intervals[-1] if self._open_intervals else None
        if last is None or last[2] != Phase.parse(within).value or seconds <= 0:
            return None
        return self.record(phase, max(last[0], last[1] - seconds), last[1], step)

    def begin(self, phase: str | Phase, step: int | None = None) -> None:
        """Say that ``phase`` starts now, for a hang watch that must know what a silent rank is doing.

        Events are written when they end; a rank stuck inside one would otherwise look like a rank
        stuck in whatever it did before. A ``begin`` record is not time (the summary skips it). Written
        only while :attr:`announce` is set and the ledger is bound.
        """
        if not self.announce or self._writer is None:
            return
        record: dict[str, Any] = {"kind": "begin", "phase": Phase.parse(phase).value, "time": time.time()}
        if step is not None:
            record["step"] = step
        with self._lock:
            if self._writer is not None:
                self._writer.append(record)

    def amend_header(self, **fields: Any) -> None:
        """Add facts learned after :meth:`bind` to this rank's ledger header."""
        with self._lock:
            if self._writer is not None:
                self._writer.append({"kind": "header", **fields})

    def fact(self, name: str, **fields: Any) -> None:
        """Record a fact the report states in words (a chosen cadence, a publisher's error).

        Facts are not time: they never enter the ETT% arithmetic. Before :meth:`bind` they
        are dropped (there is no run to report them in).
        """
        record = {"kind": "fact", "name": name, "time": time.time(), "rank": self.rank, "attempt": self.attempt, **fields}
        with self._lock:
            if self._writer is not None:
                self._writer.append(record)

    def set_status(self, status: str, reason: str | None = None) -> None:
        """Mark how this attempt ended on this rank (``finished``, ``failed`` or ``stopped`` on request, and why)."""
        record: dict[str, Any] = {"kind": "status", "status": status, "time": time.time()}
        if reason:
            record["reason"] = reason
        with self._lock:
            if self._writer is not None:
                self._writer.append(record)


_TIMELINE = Timeline()


def _finish_at_exit() -> None:
    """Record ``shutdown`` up to process exit.

    Registered when this module is imported, so it runs after the exit handlers of
    everything imported later (atexit runs them in reverse order): W&B's final sync and
    Lightning's clean-up count as shutdown.
    """
    timeline = get_timeline()
    if timeline.shutdown_from is not None:
        timeline.record(Phase.SHUTDOWN, timeline.shutdown_from, time.time())
        timeline.shutdown_from = None
    timeline.close()


atexit.register(_finish_at_exit)


def get_timeline() -> Timeline:
    """The recorder that every component of this process reports to."""
    return _TIMELINE


F = TypeVar("F", bound=Callable[..., Any])


class record_phase:
    """Time a block or a function as one phase event on this process's timeline.

    >>> with record_phase("model_init"):
    ...     model = build_model()
    >>> @record_phase("data_init")
    ... def open_dataset(): ...
    """

    def __init__(self, phase: str | Phase, step: int | None = None) -> None:
        self.phase = Phase.parse(phase)
        self.step = step
        self._start: list[float] = []

    def __enter__(self) -> Self:
        get_timeline().begin(self.phase, self.step)
        self._start.append(time.time())
        return self

    def __exit__(self, *exc: object) -> None:
        get_timeline().record(self.phase, self._start.pop(), time.time(), self.step)

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with record_phase(self.phase, self.step):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
