"""``lightning run``'s progress line: step, steps/s, ETT% so far and the phase, every few seconds, on node 0.

Read from what the launcher can already see: rank 0's ledger tail (the hang watch's
:class:`~lightning_ett.watch.progress.LedgerTail` and :class:`~lightning_ett.watch.progress.RankProgress`)
and, for ETT%, the job's summary so far. Plain lines, not a live bar: the workers write to the
same console, and a log file (the usual case on a cluster) keeps every line. Off with
``--progress-every 0``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from lightning_ett.instrument.ledger import ledger_path, read_launcher_records, read_ledger
from lightning_ett.instrument.summary import summarize
from lightning_ett.watch.progress import LedgerTail, RankProgress

DEFAULT_EVERY_S = 30.0
#: The share of its interval the line may spend on the job's summary (its ETT% so far); beyond it, ETT% is shown less often.
SUMMARY_SHARE = 0.02


class ProgressLine:
    def __init__(self, run_dir: Path, every_s: float) -> None:
        self.run_dir, self.every_s = Path(run_dir), every_s
        self._attempt, self._tail, self._rank0 = -1, None, None
        self._next = 0.0
        self._last: tuple[float, int] | None = None  # (time, trained steps) at the last line
        self._ett: float | None = None
        self._summary_due = 0.0
        self._summarizing: threading.Thread | None = None

    def attempt_started(self, attempt: int, started: float) -> None:
        self._attempt = attempt
        self._tail = LedgerTail(ledger_path(self.run_dir, attempt, 0))
        self._rank0 = RankProgress(0, last_progress=started, attempt_start=started)
        self._next, self._last = started + self.every_s, None

    def poll(self, now: float | None = None) -> str | None:
        """The line to print now, if one is due (``None`` otherwise, or before rank 0 wrote anything)."""
        now = time.time() if now is None else now
        if self._tail is None or self._rank0 is None or now < self._next:
            return None
        self._next = now + self.every_s
        for record in self._tail.read():
            self._rank0.update(record)
        rank0 = self._rank0
        if not rank0.seen:
            return None
        step = rank0.current_step  # (optimizer steps: the rate too, not batches, which accumulation multiplies)
        rate = ""
        if self._last is not None and step is not None and now > self._last[0]:
            rate = f" · {(step - self._last[1]) / (now - self._last[0]):.1f} steps/s"
        self._last = (now, step) if step is not None else None
        phase = rank0.open_phase or ("shutdown" if rank0.exited else "fit over" if rank0.done else
                                     "train" if step is not None else "start-up")
        ett = self._ett_so_far(now)
        return (f"lightning run: attempt {self._attempt} · step {step if step is not None else '-'}{rate}"
                f"{f' · ETT {ett:.1f}% so far' if ett is not None else ''} · {phase}")

    def _ett_so_far(self, now: float) -> float | None:
        """The job's ETT% as the report would say it, as of the last summary made: made on a thread of its own (a
        long job's ledgers take seconds to read, and the agent's monitor loop, which calls this, must not wait),
        at most as often as its cost allows."""
        if now >= self._summary_due and (self._summarizing is None or not self._summarizing.is_alive()):
            self._summary_due = float("inf")  # (until this one is done)
            self._summarizing = threading.Thread(target=self._summarize, args=(now,), name="ett-progress", daemon=True)
            self._summarizing.start()
        return self._ett

    def _summarize(self, now: float) -> None:
        began = time.perf_counter()
        try:
            self._ett = summarize(read_ledger(self.run_dir), now=now, launcher=read_launcher_records(self.run_dir)).ett_percent
        except Exception:  # noqa: BLE001 - a figure of the progress line: never the job's problem
            self._ett = None
        cost = time.perf_counter() - began
        self._summary_due = time.time() + max(self.every_s, cost / SUMMARY_SHARE)
