"""``lightning run``'s answer to a hang: notice it, confirm it, dump every rank's stacks, name the rank, stop the group.

The agent calls :meth:`HangWatch.poll` from its monitoring loop. The watch reads each of this
node's ranks' ledger tails (:mod:`lightning_ett.watch.progress`) and samples their process trees'
CPU and I/O (:mod:`lightning_ett.watch.activity`), so the training path pays nothing for it. The
decisions are :mod:`lightning_ett.watch.hang`'s:

1. **Suspect.** No rank wrote to its ledger for longer than the job's limit (the longest of its
   ranks' phase limits, learned from the job's own history: :mod:`lightning_ett.watch.limits`),
   and no rank whose CPU time counts is busy.
2. **Confirm** over :data:`CONFIRM_S`: each rank's flight recorder (:mod:`lightning_ett.watch.flight_recorder`),
   ledger and process tree are read twice; then, if nothing moved, two stack dumps. Any rank that
   made progress clears the suspicion: its silent peers wait for it. The watch looks again after
   a back-off.
3. **Respond.** The rank the others wait for is named from evidence, ``py-spy`` adds native frames
   where it can, and every rank's process group gets SIGTERM, a grace period, then SIGKILL. The
   agent then sees failed workers and restarts the group, counted against ``--max-restarts``; in a
   multi-node job the other nodes' agents restart theirs too, as after a crash.
4. :meth:`HangVerdict.failure_records` go into the launcher ledger: the summary turns each rank's
   time from its last progress to the kill into the ``hang`` phase.

With several nodes, each node watches its own ranks. A node whose ranks all wait inside collectives,
none of them behind, holds none of the cause: it waits for the node that does (whose watch names
the rank) as long as the longest unlearned default of any phase (30 min), the process group's own
timeout in Lightning.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_ett.durable.procfs import TreeSample, process_alive, sample_tree
from lightning_ett.instrument.ledger import ledger_path, read_launcher_records, read_ledger, recorded_attempts
from lightning_ett.launch.peers import NodeLostVerdict
from lightning_ett.lifecycle.sweeper import kill_process_groups
from lightning_ett.watch import flight_recorder
from lightning_ett.watch.activity import SAMPLE_S, Activity, ActivityMeter, activity_between
from lightning_ett.watch.flight_recorder import Collectives
from lightning_ett.watch.hang import (
    Blame,
    Evidence,
    Stall,
    all_waiting_remotely,
    blame,
    find_stall,
    rank_limit_key,
    working,
)
from lightning_ett.watch.limits import HangTimeouts, PhaseHistory
from lightning_ett.watch.progress import LedgerTail, RankProgress
from lightning_ett.watch.stacks import StackDump, py_spy_dumps, request_dumps, stack_dump_path

#: How often the ledgers are read (the agent's own loop runs every ``monitor_interval``).
POLL_S = 0.5
#: The confirmation window: a suspect job's evidence is read at its start and at its end (at most half the limit,
#: for a limit fixed below 4 s: CPU time is read in 10 ms ticks, so even 0.5 s tells work from a wait).
CONFIRM_S = 2.0
#: Between the two stack dumps of a confirmation.
STACK_GAP_S = 1.0
#: After a suspicion cleared, the watch looks again after this share of the job's limit, doubling while the same
#: silence lasts, up to MAX_BACKOFF_S.
BACKOFF_SHARE = 0.5
MAX_BACKOFF_S = 30.0


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
    culprit: Blame
    since: dict[int, float]  # each rank's last progress: its ``hang`` phase starts there
    detected: float
    stopped: float
    stall: Stall
    limits: dict[str, Any]

    @property
    def reason(self) -> str:
        where = f"hung in {self.phase}" + (f" at step {self.step}" if self.step is not None else "")
        frame = self.frames[0] if self.frames else "no stack dump"
        named = "" if self.culprit.ambiguous else f"; named by {_SOURCES[self.culprit.source]}"
        return f"{where} (rank {self.rank}: {frame}{named})" + (" [ambiguous]" if self.culprit.ambiguous else "")

    def failure_records(self) -> list[dict[str, Any]]:
        hang = {"phase": self.phase, "step": self.step, "rank": self.rank, "frames": self.frames,
                "evidence": self.culprit.evidence, "source": self.culprit.source, "ambiguous": self.culprit.ambiguous,
                "detected": self.detected, "stopped": self.stopped, "since": {str(r): t for r, t in self.since.items()},
                "silent_s": self.stall.silent_s, "limit_s": self.stall.limit_s, "limit_phase": self.stall.phase,
                "limited_by": self.stall.limited_by, "limits": self.limits}
        records = [{"kind": "failure", "attempt": self.attempt, "time": self.stopped, "rank": self.rank,
                    "exitcode": -int(signal.SIGKILL), "reason": self.reason, "root_cause": True, "hang": hang}]
        for rank in sorted(set(self.since) - {self.rank}):
            records.append({"kind": "failure", "attempt": self.attempt, "time": self.stopped, "rank": rank,
                            "exitcode": -int(signal.SIGKILL), "root_cause": False,
                            "reason": f"stopped by the launcher: the job hung (rank {self.rank})"})
        return records


_SOURCES = {"os": "the operating system", "flight_recorder": "the flight recorder", "progress": "its progress",
            "stacks": "its stack", "first_silent": "first silence"}


class HangWatch:
    """Watches this node's ranks of the running attempt (see the module docstring).

    Args:
        run_dir: the job's run directory (the ledgers).
        options: the ``--hang-*`` flags.
        num_nodes: nodes in the job (the explanation and the deferral in the module docstring).
        expects_ledgers: the job's script uses ETTMonitor (the launcher read it in the script or its
            config), so its ranks are watched from the first instant of every attempt, before they
            write anything. Otherwise they are watched once the job has written a ledger: a
            script without ETTMonitor tells the watch nothing, and silence would read as a hang.
        token: this launch's token (:mod:`lightning_ett.lifecycle.sweeper`), where the ranks serve their
            flight recorder.
    """

    def __init__(self, run_dir: Path, options: HangOptions, num_nodes: int = 1, expects_ledgers: bool = False,
                 token: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.options = options
        self.num_nodes = num_nodes
        self.token = token
        self._attempt = -1
        self._started = 0.0
        self._last_poll = 0.0
        self._backoff_until = 0.0
        self._backoff_s = 0.0
        self._episode = -1.0
        self._explained: list[float] = []  # starts of silences a working rank explained: not learned from
        self._stopped: set[int] = set()  # ranks stopped by a signal (state T): they answer no request
        self._tails: dict[int, LedgerTail] = {}
        self.progress: dict[int, RankProgress] = {}
        self.meter = ActivityMeter()
        self.history = PhaseHistory(options.timeouts)
        self._ledgers_seen = expects_ledgers or bool(recorded_attempts(self.run_dir))
        #: Suspicions cleared because a rank was working, as launcher-ledger records (the recorder writes them).
        self.cleared: list[dict[str, Any]] = []
        #: Node 0 of several: the node lost now, if any (:meth:`lightning_ett.launch.peers.PeerWatch.lost`). A
        #: confirmed stall while one is lost is stopped at once, naming it, instead of waiting for its watch.
        self.lost_node: Callable[[], tuple[int, str, float] | None] | None = None
        self._learn_from_earlier_launches()

    def _learn_from_earlier_launches(self) -> None:
        """A relaunch continues the job: learn from its earlier attempts, in the background (ledgers can be large)."""
        earlier = recorded_attempts(self.run_dir)
        if not earlier:
            return
        before = max(earlier) + 1

        def learn() -> None:
            ledgers = [lg for lg in read_ledger(self.run_dir) if lg.attempt < before]
            launcher = read_launcher_records(self.run_dir)
            explained = [float(r["time"]) - float(r.get("silent_s", 0.0)) for r in launcher if r.get("kind") == "suspicion"]
            self.history.observe_ledgers(ledgers, explained)
            for record in launcher:  # a phase the watch stopped the job in keeps its default (PhaseHistory.escalate)
                if isinstance(record.get("hang"), dict) and record["hang"].get("limit_phase"):
                    self.history.escalate(str(record["hang"]["limit_phase"]))

        threading.Thread(target=learn, name="ett-hang-history", daemon=True).start()

    def attempt_started(self, attempt: int, started: float) -> None:
        self._attempt, self._started = attempt, started
        self._tails, self.progress = {}, {}
        self.meter = ActivityMeter()
        self._backoff_until = 0.0

    def poll(self, workers: dict[int, tuple[int, str | None]]) -> HangVerdict | NodeLostVerdict | None:
        """Read the ledgers (at most every :data:`POLL_S`); on a hang, respond and return the verdict.

        ``workers`` maps each global rank of this node to its pid and its stderr log.
        """
        now = time.time()
        if now - self._last_poll < POLL_S:
            return None
        self._last_poll = now
        self._read_tails(workers)
        # A rank that has written nothing yet is watched only once its job showed that it writes a ledger.
        self._ledgers_seen = self._ledgers_seen or any(p.seen for p in self.progress.values())
        # A rank whose script has ended (it wrote its shutdown at exit) waits for the agent to collect it: not watched.
        watched = {rank: self.progress[rank] for rank, (pid, _) in workers.items()
                   if (self.progress[rank].seen or self._ledgers_seen) and not self.progress[rank].exited
                   and process_alive(pid)}
        pids = {rank: workers[rank][0] for rank in watched}
        self.meter.sample(pids, now)
        stall = find_stall(watched, self.history, now)
        if stall is None or now < self._backoff_until or not watched:
            return None
        busy_counts = stall.silent_s <= self.options.timeouts.busy_ceiling(stall.phase)
        if busy_counts and (busy := self._busy_without_recorder(watched, now)) is not None:
            self._clear(stall, *busy)
            return None
        return self._confirm(stall, watched, workers, busy_counts)

    def _read_tails(self, workers: dict[int, tuple[int, str | None]]) -> None:
        for rank in workers:
            tail = self._tails.setdefault(rank, LedgerTail(ledger_path(self.run_dir, self._attempt, rank)))
            progress = self.progress.setdefault(rank, RankProgress(rank, last_progress=self._started,
                                                                   attempt_start=self._started))
            for record in tail.read():
                ended = progress.update(record)
                if ended is not None:
                    phase, seconds, steps_before = ended
                    start, end = float(record.get("start", 0.0)), float(record.get("end", 0.0))
                    if not any(start <= t <= end for t in self._explained):  # see PhaseHistory.observe_ledgers
                        self.history.observe_event(phase, seconds, steps_before, start - progress.attempt_start)

    def _busy_without_recorder(self, ranks: dict[int, RankProgress], now: float) -> tuple[int, str] | None:
        """A rank busy right now by evidence that needs no flight recorder: I/O anywhere, CPU off CUDA."""
        recent = now - 2 * SAMPLE_S
        for rank, progress in ranks.items():
            if progress.device != "cuda" and self.meter.busy_cpu_at.get(rank, 0.0) >= recent:
                activity = self.meter.latest.get(rank)
                return rank, f"its processes use {activity.cpu:.0%} of a core" if activity else "its processes use CPU"
        for rank in ranks:
            if self.meter.busy_io_at.get(rank, 0.0) >= recent:
                activity = self.meter.latest.get(rank)
                return rank, f"its processes move {activity.io_per_s / 1e6:.1f} MB/s" if activity else "its processes move data"
        return None

    def _clear(self, stall: Stall, rank: int, why: str) -> None:
        """Not hung: a rank works. Said once per silence (in the launcher ledger); looked at again after a back-off
        that doubles while the same silence lasts."""
        now = time.time()
        if stall.since != self._episode:  # one silence, one record
            self._episode, self._backoff_s = stall.since, BACKOFF_SHARE * stall.limit_s
            self._explained = [*self._explained[-63:], stall.since]
            self.cleared.append({"kind": "suspicion", "attempt": self._attempt, "time": now, "working_rank": rank,
                                 "evidence": why, "silent_s": round(stall.silent_s, 3), "limit_s": round(stall.limit_s, 3),
                                 "limit_phase": stall.phase, "limited_by": stall.limited_by})
        else:
            self._backoff_s = min(2 * self._backoff_s, MAX_BACKOFF_S)
        self._backoff_until = now + min(self._backoff_s, MAX_BACKOFF_S)

    def _evidence(self, ranks: dict[int, RankProgress], stacks: dict[int, StackDump | None] | None = None,
                  collectives: dict[int, Collectives | None] | None = None) -> dict[int, Evidence]:
        collectives = collectives if collectives is not None else self._collectives(list(ranks))
        return {rank: Evidence(p.last_progress, collectives.get(rank), (stacks or {}).get(rank))
                for rank, p in ranks.items()}

    def _collectives(self, ranks: list[int]) -> dict[int, Collectives | None]:
        asked = [rank for rank in ranks if rank not in self._stopped]  # a stopped process cannot answer: do not wait
        answers = flight_recorder.request(self.token, self._attempt, asked) if self.token is not None else {}
        return {rank: answers.get(rank) for rank in ranks}

    def _dumps(self, pids: dict[int, int], logs: dict[int, str | None]) -> dict[int, StackDump | None]:
        asked = {rank: pid for rank, pid in pids.items() if rank not in self._stopped}
        return {rank: None for rank in pids} | request_dumps(asked, {rank: self._stack_file(rank, logs) for rank in asked})

    def _stack_file(self, rank: int, logs: dict[int, str | None]) -> str | None:
        """Where ``rank`` writes its stack dumps: its own file (the console stays quiet), else its worker log."""
        path = stack_dump_path(self.run_dir, self._attempt, rank)
        return str(path) if path.exists() else logs.get(rank)

    def _confirm(self, stall: Stall, ranks: dict[int, RankProgress], workers: dict[int, tuple[int, str | None]],
                 busy_counts: bool) -> HangVerdict | NodeLostVerdict | None:
        pids = {rank: workers[rank][0] for rank in ranks}
        logs = {rank: workers[rank][1] for rank in ranks}
        samples = _samples(pids)
        self._stopped = {rank for rank, sample in samples.items() if sample is not None and sample.state in ("T", "t")}
        first = self._evidence(ranks)
        window = min(CONFIRM_S, stall.limit_s / 2)
        time.sleep(window)
        self._read_tails(workers)
        second, activity = self._evidence(ranks), _activity(samples, _samples(pids), window)
        if moved := working(first, second, activity, busy_counts):
            self._clear(stall, *next(iter(moved.items())))
            return None
        stacks_a = self._dumps(pids, logs)
        time.sleep(min(STACK_GAP_S, stall.limit_s / 4))
        self._read_tails(workers)
        stacks_b = self._dumps(pids, logs)
        collectives = {rank: e.collectives for rank, e in second.items()}
        before_stacks = {rank: Evidence(e.last_progress, e.collectives, stacks_a.get(rank)) for rank, e in second.items()}
        if moved := working(before_stacks, self._evidence(ranks, stacks_b, collectives), {}):
            self._clear(stall, *next(iter(moved.items())))
            return None
        if self.lost_node is not None and (lost := self.lost_node()) is not None:
            return self._node_lost(lost, ranks, pids)  # stalled, and a node is silent: it is the cause, and says nothing
        if (self.num_nodes > 1 and all_waiting_remotely(ranks, stacks_b, collectives)
                and stall.silent_s < self.options.timeouts.longest_default()):
            # This node holds none of the cause; the node that does may be doing legitimate slow work in a phase
            # with a long limit that this node cannot see: wait as long as the longest of them.
            self._clear(stall, -1, "the rank holding this node's ranks up is on another node, whose watch decides")
            return None
        states = {rank: (activity[rank].state if rank in activity else None) for rank in ranks}
        return self._respond(stall, ranks, pids, stacks_b, collectives, states)

    def _node_lost(self, lost: tuple[int, str, float], ranks: dict[int, RankProgress],
                   pids: dict[int, int]) -> NodeLostVerdict:
        node, address, since = lost
        stopping = time.time()
        stopped = stop_processes(list(pids.values()), self.options.grace_s)
        return NodeLostVerdict(self._attempt, node, address, since, stopped, sorted(ranks), stopping=stopping)

    def _respond(self, stall: Stall, ranks: dict[int, RankProgress], pids: dict[int, int],
                 stacks: dict[int, StackDump | None], collectives: dict[int, Collectives | None],
                 states: dict[int, str | None]) -> HangVerdict:
        detected = time.time()
        stall = replace(stall, silent_s=detected - stall.since)  # as long as it was when the watch acted
        native = {rank: stack_dump_path(self.run_dir, self._attempt, rank).with_name(f"rank-{rank:05d}.py-spy.txt")
                  for rank in pids if rank not in self._stopped}  # py-spy cannot attach to a stopped process either
        spy = threading.Thread(target=py_spy_dumps, args=({r: pids[r] for r in native}, native), daemon=True,
                               name="ett-py-spy")
        spy.start()
        culprit = blame(ranks, stacks, collectives, states, self.num_nodes)
        spy.join(10.0)
        stopped = stop_processes(list(pids.values()), self.options.grace_s)
        blamed = ranks[culprit.rank]
        for key in {stall.phase, rank_limit_key(blamed)}:  # a wrong verdict must not recur (PhaseHistory.escalate)
            self.history.escalate(key)
        return HangVerdict(
            attempt=self._attempt, rank=culprit.rank, phase=blamed.open_phase or rank_limit_key(blamed),
            step=blamed.current_step, frames=_frames(stacks.get(culprit.rank)), culprit=culprit,
            since={rank: p.last_progress for rank, p in ranks.items()}, detected=detected, stopped=stopped,
            stall=stall, limits=self.history.learned(),
        )


def _samples(pids: dict[int, int]) -> dict[int, TreeSample | None]:
    return {rank: sample_tree(pid) for rank, pid in pids.items()}


def _activity(before: dict[int, TreeSample | None], after: dict[int, TreeSample | None], seconds: float) -> dict[int, Activity]:
    return {rank: activity_between(b, a, seconds) for rank, b in before.items()
            if b is not None and (a := after.get(rank)) is not None}


def _frames(dump: StackDump | None) -> list[str]:
    """The culprit frame first, then the innermost frames of the main thread."""
    if dump is None:
        return []
    culprit = dump.culprit_frame()
    top = dump.top(6)
    return ([str(culprit)] if culprit is not None else []) + [f for f in top if f != str(culprit)][:5]


def stop_processes(pids: list[int], grace_s: float) -> float:
    """SIGTERM to each worker's process group, up to ``grace_s`` for them to exit, then SIGKILL; returns when the
    workers are gone (or after 10 s). Signalling the groups reaches what the workers started (DataLoader workers)."""
    kill_process_groups(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(map(process_alive, pids)):
        time.sleep(0.05)
    kill_process_groups(pids, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(map(process_alive, pids)):
        time.sleep(0.02)
    return time.time()
