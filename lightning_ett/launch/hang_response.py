"""``lightning run``'s answer to a hang: notice it, dump every rank's stacks, name the rank, stop the group.

The agent calls :meth:`HangWatch.poll` from its monitoring loop. The watch reads each of this
node's ranks' ledger tails (:mod:`lightning_ett.watch.progress`), so the training path pays
nothing for it. When a rank stays silent past its phase's limit (:mod:`lightning_ett.watch.hang`):

1. every rank dumps all its threads' Python stacks into its worker log (faulthandler, on
   :data:`~lightning_ett.watch.stacks.DUMP_SIGNAL`), and ``py-spy`` adds native frames where it can;
2. the root-cause rank is named from evidence;
3. the group gets SIGTERM, a grace period, then SIGKILL. The agent then sees failed workers and
   restarts the group, counted against ``--max-restarts``; in a multi-node job the other nodes'
   agents restart theirs too, as after a crash;
4. :meth:`HangVerdict.failure_records` go into the launcher ledger: the summary turns each
   rank's time from its last progress to the kill into the ``hang`` phase.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_ett.durable.ownership import process_alive
from lightning_ett.instrument.ledger import ledger_path, recorded_attempts
from lightning_ett.watch.hang import HangTimeouts, Stall, blame, find_stall
from lightning_ett.watch.progress import LedgerTail, RankProgress
from lightning_ett.watch.stacks import StackDump, py_spy_dumps, request_dumps

#: How often the ledgers are read (the agent's own loop runs every ``monitor_interval``).
POLL_S = 0.5


@dataclass(frozen=True)
class HangOptions:
    """``lightning run``'s hang flags: the timeouts, the SIGTERM grace, and whether to watch at all."""

    timeouts: HangTimeouts = field(default_factory=HangTimeouts)
    grace_s: float = 1.0
    enabled: bool = True

    def __post_init__(self) -> None:
        if not self.grace_s >= 0:
            raise ValueError(f"--hang-grace {self.grace_s!r}: expected seconds >= 0, e.g. 1.")


@dataclass(frozen=True)
class HangVerdict:
    """What the watch found and did: written to the launcher ledger as failure records."""

    attempt: int
    rank: int
    phase: str
    step: int | None
    frames: list[str]
    evidence: str
    ambiguous: bool
    since: dict[int, float]  # each rank's last progress: its ``hang`` phase starts there
    detected: float
    stopped: float
    stall: Stall

    @property
    def reason(self) -> str:
        where = f"hung in {self.phase}" + (f" at step {self.step}" if self.step is not None else "")
        frame = self.frames[0] if self.frames else "no stack dump"
        return f"{where} (rank {self.rank}: {frame})" + (" [ambiguous]" if self.ambiguous else "")

    def failure_records(self) -> list[dict[str, Any]]:
        hang = {"phase": self.phase, "step": self.step, "rank": self.rank, "frames": self.frames,
                "evidence": self.evidence, "ambiguous": self.ambiguous, "detected": self.detected,
                "stopped": self.stopped, "since": {str(r): t for r, t in self.since.items()},
                "silent_s": self.stall.silent_s, "limit_s": self.stall.limit_s, "stalled_rank": self.stall.rank}
        records = [{"kind": "failure", "attempt": self.attempt, "time": self.stopped, "rank": self.rank,
                    "exitcode": -int(signal.SIGKILL), "reason": self.reason, "root_cause": True, "hang": hang}]
        for rank in sorted(set(self.since) - {self.rank}):
            records.append({"kind": "failure", "attempt": self.attempt, "time": self.stopped, "rank": rank,
                            "exitcode": -int(signal.SIGKILL), "root_cause": False,
                            "reason": f"stopped by the launcher: the job hung (rank {self.rank})"})
        return records


class HangWatch:
    """Watches this node's ranks of the running attempt (see the module docstring)."""

    def __init__(self, run_dir: Path, options: HangOptions) -> None:
        self.run_dir = Path(run_dir)
        self.options = options
        self._attempt = -1
        self._started = 0.0
        self._last_poll = 0.0
        self._tails: dict[int, LedgerTail] = {}
        self.progress: dict[int, RankProgress] = {}
        self._ledgers_seen = bool(recorded_attempts(self.run_dir))  # this job's ranks write ledgers

    def attempt_started(self, attempt: int, started: float) -> None:
        self._attempt, self._started = attempt, started
        self._tails, self.progress = {}, {}

    def poll(self, workers: dict[int, tuple[int, str | None]]) -> HangVerdict | None:
        """Read the ledgers (at most every :data:`POLL_S`); on a hang, respond and return the verdict.

        ``workers`` maps each global rank of this node to its pid and its stderr log.
        """
        now = time.time()
        if now - self._last_poll < POLL_S:
            return None
        self._last_poll = now
        for rank in workers:
            tail = self._tails.setdefault(rank, LedgerTail(ledger_path(self.run_dir, self._attempt, rank)))
            progress = self.progress.setdefault(rank, RankProgress(rank, last_progress=self._started))
            for record in tail.read():
                progress.update(record)
        # A rank that has written nothing yet is watched only once its job showed that it writes a ledger:
        # a script without ETTMonitor tells the watch nothing, and silence would read as a hang.
        self._ledgers_seen = self._ledgers_seen or any(p.seen for p in self.progress.values())
        watched = {rank: self.progress[rank] for rank, (pid, _) in workers.items()
                   if (self.progress[rank].seen or self._ledgers_seen) and process_alive(pid)}
        stall = find_stall(watched, self.options.timeouts, now)
        return None if stall is None else self._respond(stall, watched, workers)

    def _respond(self, stall: Stall, ranks: dict[int, RankProgress],
                 workers: dict[int, tuple[int, str | None]]) -> HangVerdict:
        detected = time.time()
        pids = {rank: pid for rank, (pid, _) in workers.items()}
        logs = {rank: log for rank, (_, log) in workers.items()}
        native = {rank: Path(log).parent / "py-spy-native.txt" for rank, log in logs.items() if log}
        spy = threading.Thread(target=py_spy_dumps, args=({r: pids[r] for r in native}, native), daemon=True,
                               name="ett-py-spy")
        spy.start()
        stacks = request_dumps(pids, logs)
        culprit = blame(ranks, stacks)
        spy.join(10.0)
        stopped = stop_processes(list(pids.values()), self.options.grace_s)
        blamed = ranks[culprit.rank]
        return HangVerdict(
            attempt=self._attempt, rank=culprit.rank, phase=blamed.phase, step=blamed.current_step,
            frames=_frames(stacks.get(culprit.rank)), evidence=culprit.evidence, ambiguous=culprit.ambiguous,
            since={rank: p.last_progress for rank, p in ranks.items()}, detected=detected, stopped=stopped,
            stall=stall,
        )


def _frames(dump: StackDump | None) -> list[str]:
    """The culprit frame first, then the innermost frames of the main thread."""
    if dump is None:
        return []
    culprit = dump.culprit_frame()
    top = dump.top(6)
    return ([str(culprit)] if culprit is not None else []) + [f for f in top if f != str(culprit)][:5]


def stop_processes(pids: list[int], grace_s: float) -> float:
    """SIGTERM, up to ``grace_s`` for them to exit, then SIGKILL; returns when they are gone (or after 10 s)."""
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(map(process_alive, pids)):
        time.sleep(0.05)
    _signal_all([pid for pid in pids if process_alive(pid)], signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(map(process_alive, pids)):
        time.sleep(0.02)
    return time.time()


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
