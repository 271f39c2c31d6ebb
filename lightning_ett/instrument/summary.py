"""Merge ranks and attempts into the job's ETT%: effective, lost, and where the rest went.

Rules (also in the README's "How ETT% is measured"):

* The job's wall time runs from the earliest job start any attempt was given to the last
  event any rank recorded.
* On each rank the innermost event owns the time it covers (a checkpoint save inside a
  training-step interval is ``checkpoint_save``, not ``train``). Time no event covers is
  ``launch`` before an attempt's first event (restart downtime included), ``shutdown`` after
  a rank's last event of the job, and ``other`` anywhere else.
* A training step run in an attempt is ``lost`` when a later attempt ran from that step or
  earlier again: its result was discarded. Each step thus counts as effective once, in the
  attempt whose result the job kept.
* Job-level phase seconds are the mean over ranks, so they add up to the wall time.
* Under ``lightning run`` the launcher's records widen the wall time to its own start and
  end, and say why each failed attempt ended.
* A hang the launcher stopped is ``hang`` on each of its node's ranks, from the rank's last
  progress to the kill: what waiting for the hang cost.
* A node lost in a multi-node job (node 0's launcher: ``node_lost``) is ``node_lost`` on every rank,
  from its last heartbeat to the start of the next attempt: noticing it and waiting for it, or a
  replacement, to rejoin. The steps re-run after it are ``lost``, as after any failure. A rank's
  event still open when the attempt was stopped (a save blocked on the lost node, recorded as it
  unwound) does not own that window: it was the wait, not the work.
"""

from __future__ import annotations

import contextlib
import heapq
import ipaddress
import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_ett.durable.files import atomic_write_json
from lightning_ett.instrument.ledger import RankLedger, read_launcher_records, read_ledger, stopped_attempts
from lightning_ett.instrument.step_health import step_health_summary
from lightning_ett.instrument.straggler_facts import straggler_digest
from lightning_ett.instrument.timeline import LOST, PHASE_NAMES, STRAGGLER_FACT, Phase

SUMMARY_FILE = "ett_summary.json"
#: Node 0 notes a heartbeat when it reads it, up to a period (2 s) after it was sent: a failure that came just before
#: the lost node's last heartbeat as node 0 noted it is still that loss's.
HEARTBEAT_SLACK_S = 5.0


@dataclass
class Segment:
    phase: str
    start: float
    end: float


@dataclass
class AttemptInfo:
    attempt: int
    start: float
    end: float
    ranks: list[int]
    first_step: int | None
    last_step: int | None
    completed: bool
    failure: str | None = None
    stopped: str | None = None  # stopped on request (Ctrl-C, a scheduler's SIGTERM): how, instead of a failure


@dataclass
class Summary:
    job_start: float
    job_end: float
    phases: dict[str, float]
    attempts: list[AttemptInfo]
    per_rank: dict[int, dict[str, float]]
    segments: dict[int, list[Segment]] = field(repr=False)
    torn_records: int = 0
    outcome: str | None = None  # the launcher's last word: "finished", "gave up after ...", ...
    facts: list[dict[str, Any]] = field(default_factory=list)  # Timeline.fact records of every rank, by time
    step_health: dict[str, Any] = field(default_factory=dict)  # see lightning_ett.instrument.step_health
    #: The hang watch's cleared suspicions (launcher ``suspicion`` records): silences past a limit that were work.
    suspicions: list[dict[str, Any]] = field(default_factory=list)
    #: Nodes lost and back, as node 0's launcher saw them (``node_lost`` / ``node_back`` records), by time.
    nodes: list[dict[str, Any]] = field(default_factory=list)

    def facts_named(self, name: str) -> list[dict[str, Any]]:
        return [f for f in self.facts if f.get("name") == name]

    @property
    def stragglers(self) -> dict[str, Any] | None:
        """The straggler diagnosis (a digest of its per-window facts); ``None`` when none ran."""
        return straggler_digest(self.facts_named(STRAGGLER_FACT))

    @property
    def wall_s(self) -> float:
        return max(self.job_end - self.job_start, 0.0)

    @property
    def effective_s(self) -> float:
        return self.phases.get(Phase.TRAIN.value, 0.0)

    @property
    def lost_s(self) -> float:
        return self.phases.get(LOST, 0.0)

    @property
    def ett_percent(self) -> float:
        return 100.0 * self.effective_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def completed(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].completed

    def to_dict(self) -> dict[str, Any]:
        return {
            "ett_percent": round(self.ett_percent, 3),
            "wall_s": round(self.wall_s, 3),
            "effective_s": round(self.effective_s, 3),
            "lost_s": round(self.lost_s, 3),
            "attempts": len(self.attempts),
            "completed": self.completed,
            "job_start": self.job_start,
            "job_end": self.job_end,
            "phases": {k: round(v, 3) for k, v in self.phases.items()},
            "per_rank": {str(r): {k: round(v, 3) for k, v in p.items()} for r, p in self.per_rank.items()},
            "attempt_details": [vars(a) for a in self.attempts],
            "torn_records": self.torn_records,
            "outcome": self.outcome,
            "hang_watch_suspicions": len(self.suspicions),
            "nodes": self.nodes,
            "facts": [f for f in self.facts if f.get("name") != STRAGGLER_FACT],  # one per window: digested below
            "stragglers": self.stragglers,
            "step_health": self.step_health,
        }

    def write_json(self, run_dir: str | os.PathLike) -> Path:
        """Write ``ett_summary.json`` atomically, so readers never see half."""
        return atomic_write_json(Path(run_dir) / SUMMARY_FILE, self.to_dict(), indent=2)


def _train_steps(ledger: RankLedger) -> list[int]:
    return [e["step"] for e in ledger.events if e["phase"] == Phase.TRAIN.value and e.get("step") is not None]


def _resume_steps(ledgers: list[RankLedger], later_resume_step: int | None) -> dict[int, int]:
    """For each attempt, the lowest step any later attempt (re)started from."""
    first_step: dict[int, int] = {}
    for ledger in ledgers:
        steps = _train_steps(ledger)
        if steps:
            first_step[ledger.attempt] = min(first_step.get(ledger.attempt, steps[0]), min(steps))
    attempts = sorted({ledger.attempt for ledger in ledgers})
    resume: dict[int, int] = {}
    running_min = later_resume_step
    for attempt in reversed(attempts):
        if running_min is not None:
            resume[attempt] = running_min
        if attempt in first_step:
            running_min = first_step[attempt] if running_min is None else min(running_min, first_step[attempt])
    return resume


def _innermost(events: list[tuple[str, float, float]]) -> list[Segment]:
    """Split overlapping events into segments owned by the innermost (latest-started) event."""
    if not events:
        return []
    events = sorted(events, key=lambda e: (e[1], -e[2]))
    bounds = sorted({t for _, s, e in events for t in (s, e)})
    segments: list[Segment] = []
    heap: list[tuple[float, float, float, str]] = []  # (-start, duration, end, phase)
    i = 0
    for lo, hi in itertools.pairwise(bounds):
        while i < len(events) and events[i][1] <= lo:
            phase, s, e = events[i]
            heapq.heappush(heap, (-s, e - s, e, phase))
            i += 1
        while heap and heap[0][2] <= lo:
            heapq.heappop(heap)
        phase = heap[0][3] if heap else Phase.OTHER.value
        if segments and segments[-1].phase == phase and segments[-1].end == lo:
            segments[-1].end = hi
        else:
            segments.append(Segment(phase, lo, hi))
    return segments


def _hang_events(launcher: list[dict[str, Any]]) -> dict[tuple[int, int], list[tuple[str, float, float]]]:
    """``(attempt, rank) -> [("hang", last progress, kill)]`` from the launcher's hang verdicts."""
    found: dict[tuple[int, int], list[tuple[str, float, float]]] = {}
    for record in launcher:
        hang = record.get("hang")
        if record.get("kind") != "failure" or not isinstance(hang, dict):
            continue
        try:
            stopped = float(hang["stopped"])
            for rank, since in dict(hang["since"]).items():
                if float(since) < stopped:
                    found.setdefault((int(record["attempt"]), int(rank)), []).append(
                        (Phase.HANG.value, float(since), stopped))
        except (KeyError, TypeError, ValueError):
            continue  # a hand-edited record: its time stays where the ranks' ledgers put it
    return found


def _losses_that_ended_attempts(launcher: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
    """``node_lost`` records whose attempt then failed (at or after the node's last heartbeat, before it was back),
    each with the instant the attempt was being ended: the attempt's first failure, or, when node 0 stopped it for
    this loss, the start of that stop (its SIGTERM: the failure is stamped once the ranks are gone), if earlier.

    A node silent while the ranks trained on (a blip on the store's network) ended nothing: not charged."""
    backs = [r for r in launcher if r.get("kind") == "node_back"]
    ended = []
    for record in launcher:
        if record.get("kind") != "node_lost":
            continue
        try:
            attempt, since, node = int(record["attempt"]), float(record["since"]), int(record["node_rank"])
        except (KeyError, TypeError, ValueError):
            continue
        back = min((float(b["time"]) for b in backs if b.get("node_rank") == node and float(b["time"]) > since),
                   default=float("inf"))
        failures = [r for r in launcher if r.get("kind") == "failure" and r.get("attempt") == attempt
                    and since - HEARTBEAT_SLACK_S <= float(r["time"]) <= back]
        if failures:
            ended.append((record, min([float(r["time"]) for r in failures] + _stops_for(failures, node))))
    return ended


def _stops_for(failures: list[dict[str, Any]], node: int) -> list[float]:
    """When node 0's stops of an attempt for ``node``'s loss began (``failure["node_lost"]["stopping"]``; ledgers
    older than it have only the failure's own time)."""
    stops = []
    for failure in failures:
        lost = failure.get("node_lost")
        if isinstance(lost, dict) and lost.get("node") == node:
            with contextlib.suppress(KeyError, TypeError, ValueError, OverflowError):
                stops.append(float(lost["stopping"]))
    return stops


def _node_lost_events(ledgers: list[RankLedger], launcher: list[dict[str, Any]], losses: list[tuple[dict[str, Any], float]],
                      job_end: float) -> dict[tuple[int, int], list[tuple[str, float, float]]]:
    """``(attempt, rank) -> [("node_lost", last heartbeat, next attempt's start)]`` for every rank of the attempt."""
    starts = sorted((float(r["time"]), int(r["attempt"])) for r in launcher if r.get("kind") == "attempt")
    found: dict[tuple[int, int], list[tuple[str, float, float]]] = {}
    for record, _ in losses:
        attempt, since = int(record["attempt"]), float(record["since"])
        until = min((t for t, a in starts if a > attempt and t > since), default=job_end)
        for ledger in ledgers:
            if ledger.attempt == attempt:
                found.setdefault((attempt, ledger.rank), []).append((Phase.NODE_LOST.value, since, until))
    return found


def _stalled_by_lost_nodes(losses: list[tuple[dict[str, Any], float]]) -> dict[int, list[tuple[float, float]]]:
    """``attempt -> [(last heartbeat, ending)]``: a rank's event of that attempt still open when the attempt was
    being ended (:func:`_losses_that_ended_attempts`) waited on the lost node (recorded as it unwound); it does not
    own the ``node_lost`` window.

    Without this, whether the window is charged to the loss depended on what the partition interrupted: a step
    (never recorded) or a save (recorded when it failed, 60 s later, and innermost)."""
    found: dict[int, list[tuple[float, float]]] = {}
    for record, ending in losses:
        found.setdefault(int(record["attempt"]), []).append((float(record["since"]), ending))
    return found


def _clip_stalled(start: float, end: float, stalls: list[tuple[float, float]]) -> tuple[float, float]:
    """``(start, end)`` less any part after a lost node's last heartbeat, when the event was still open as the
    attempt was being ended (:func:`_stalled_by_lost_nodes`); ``end <= start`` when nothing is left. Each loss is
    checked against the event's own end, so the order of the records does not matter."""
    return start, min((max(since, start) for since, ending in stalls if start < ending < end), default=end)


def _rank_segments(
    ledgers: list[RankLedger], resume: dict[int, int], job_start: float, job_end: float,
    extra: dict[tuple[int, int], list[tuple[str, float, float]]] | None = None,
    stalls: dict[int, list[tuple[float, float]]] | None = None,
) -> list[Segment]:
    segments: list[Segment] = []
    cursor = job_start
    for ledger in sorted(ledgers, key=lambda lg: lg.attempt):
        cutoff = resume.get(ledger.attempt)
        events = [(p, max(s, cursor), e) for p, s, e in (extra or {}).get((ledger.attempt, ledger.rank), [])
                  if e > max(s, cursor)]
        for e in ledger.events:
            start, end = _clip_stalled(max(e["start"], cursor), e["end"], (stalls or {}).get(ledger.attempt, []))
            if end <= start:
                continue
            phase = e["phase"]
            if phase == Phase.TRAIN.value and cutoff is not None and e.get("step") is not None and e["step"] >= cutoff:
                phase = LOST
            events.append((phase, start, end))
        own = _innermost(events)
        if not own:
            continue
        if own[0].start > cursor:
            segments.append(Segment(Phase.LAUNCH.value, cursor, own[0].start))
        segments.extend(own)
        cursor = own[-1].end
    if cursor < job_end:
        segments.append(Segment(Phase.SHUTDOWN.value, cursor, job_end))
    return segments


def summarize(
    ledgers: list[RankLedger],
    later_resume_step: int | None = None,
    now: float | None = None,
    launcher: list[dict[str, Any]] | None = None,
) -> Summary:
    """Compute the job summary from ledgers (see the module docstring for the rules).

    ``later_resume_step`` lets a running attempt count its predecessors' lost steps before it
    has written any; ``now`` extends the wall time of a running job to the present;
    ``launcher`` are the launcher's records (:func:`lightning_ett.instrument.ledger.read_launcher_records`).
    """
    launcher = launcher or []
    starts = [lg.header.get("job_start") for lg in ledgers if lg.header.get("job_start") is not None]
    starts += [e["start"] for lg in ledgers for e in lg.events]
    starts += [r[k] for r in launcher if r.get("kind") == "launch" for k in ("job_start", "time") if k in r]
    ends = [e["end"] for lg in ledgers for e in lg.events]
    ends += [r["time"] for r in launcher if r.get("kind") in ("failure", "end")]
    if not starts or not ends:
        torn = sum(lg.torn_lines for lg in ledgers)
        if torn:
            raise ValueError(f"The ledger has no valid events: {torn} line(s) skipped as invalid (torn by a kill "
                             "mid-write, or not a ledger record); nothing to summarize.")
        raise ValueError("The ledger has no events yet: nothing to summarize.")
    job_start, job_end = min(starts), max(ends + ([now] if now is not None else []))
    resume = _resume_steps(ledgers, later_resume_step)

    by_rank: dict[int, list[RankLedger]] = {}
    for ledger in ledgers:
        by_rank.setdefault(ledger.rank, []).append(ledger)
    hangs = _hang_events(launcher)
    losses = _losses_that_ended_attempts(launcher)  # (once: it scans every record for each loss)
    for key, events in _node_lost_events(ledgers, launcher, losses, job_end).items():
        hangs.setdefault(key, []).extend(events)
    stalls = _stalled_by_lost_nodes(losses)
    segments = {rank: _rank_segments(lgs, resume, job_start, job_end, hangs, stalls)
                for rank, lgs in sorted(by_rank.items())}
    per_rank: dict[int, dict[str, float]] = {}
    for rank, segs in segments.items():
        totals = dict.fromkeys(PHASE_NAMES, 0.0)
        for seg in segs:
            totals[seg.phase] += seg.end - seg.start
        per_rank[rank] = totals
    phases = {name: sum(p[name] for p in per_rank.values()) / max(len(per_rank), 1) for name in PHASE_NAMES}
    if not any(lg.events for lg in ledgers):  # no rank got as far as recording: the job never left launch
        phases[Phase.LAUNCH.value] = job_end - job_start
    ends_said = [r for r in launcher if r.get("kind") == "end"]
    last_launch = max((r.get("time", 0.0) for r in launcher if r.get("kind") == "launch"), default=0.0)
    # A stop asked of one node's launcher ends the job on every node; another node, whose workers Lightning let exit 0
    # on the SIGTERM that came through the process group, says "finished": the stop is the job's outcome.
    stops = [r for r in ends_said if r.get("time", 0.0) >= last_launch and str(r.get("reason", "")).startswith("stopped by")]
    outcome = (stops or ends_said)[-1].get("reason") if ends_said else None
    facts = sorted((f for lg in ledgers for f in lg.facts), key=lambda f: f.get("time", 0.0))
    first_rank = [lg for lg in ledgers if lg.rank == min(by_rank)]  # rank 0's steps, as the live figures
    health = step_health_summary((e for lg in first_rank for e in lg.events), segments, job_start, job_end)
    return Summary(job_start, job_end, phases, _attempts(ledgers, launcher, [r for r, _ in losses]), per_rank, segments,
                   sum(lg.torn_lines for lg in ledgers), outcome, facts, health,
                   [r for r in launcher if r.get("kind") == "suspicion"],
                   sorted((r for r in launcher if r.get("kind") in ("node_lost", "node_back")), key=lambda r: r["time"]))


def _finished_by_launcher(launcher: list[dict[str, Any]]) -> set[int]:
    """Attempts the launcher saw end with exit code 0 (its ``end`` record follows their start):
    finished even if no rank recorded a status (a script that exits before training)."""
    finished, current = set(), None
    for r in launcher:  # by time
        if r.get("kind") == "attempt":
            current = int(r["attempt"])
        elif r.get("kind") == "end" and r.get("exitcode") == 0 and current is not None:
            finished.add(current)
    return finished


def _node_addresses(launcher: list[dict[str, Any]]) -> dict[str, int]:
    """Each node's IP address, from its launches; an address more than one node rank launched from names none."""
    ranks: dict[str, set[int]] = {}
    for r in launcher:
        if r.get("kind") == "launch" and r.get("address") and r.get("node_rank") is not None:
            with contextlib.suppress(ValueError):
                ranks.setdefault(str(ipaddress.ip_address(r["address"])), set()).add(int(r["node_rank"]))
    return {address: next(iter(nodes)) for address, nodes in ranks.items() if len(nodes) == 1}


def _with_nodes_named(failure: str, node_addresses: dict[str, int]) -> str:
    """``failure`` with the nodes whose addresses it names (``Connection reset by peer [10.0.0.2]:5851``) said, in a
    job of several nodes: a node that died and was replaced before node 0 called it lost is otherwise unnamed."""
    if len(set(node_addresses.values())) < 2:
        return failure
    named = [f"{address} is node {node}" for address, node in sorted(node_addresses.items(), key=lambda kv: kv[1])
             if re.search(rf"(?<![\d.]){re.escape(address)}(?![\d])", failure)]
    return f"{failure} ({'; '.join(named)})" if named else failure


def _attempts(ledgers: list[RankLedger], launcher: list[dict[str, Any]],
              ended_by_loss: list[dict[str, Any]]) -> list[AttemptInfo]:
    started = {int(r["attempt"]): r["time"] for r in reversed(launcher) if r.get("kind") == "attempt"}
    finished = _finished_by_launcher(launcher)
    stops = stopped_attempts(launcher)
    node_addresses = _node_addresses(launcher)
    failures: dict[int, list[dict[str, Any]]] = {}
    for r in launcher:
        if r.get("kind") == "failure":
            failures.setdefault(int(r["attempt"]), []).append(r)
    infos = []
    for attempt in sorted({lg.attempt for lg in ledgers} | set(started)):
        group = [lg for lg in ledgers if lg.attempt == attempt and lg.events]
        said = failures.get(attempt, [])
        if any("hang" in r and not r["hang"].get("ambiguous") for r in said):
            # Several nodes' watches each named a rank: the ones with evidence outrank the guesses.
            said = [r for r in said if not ("hang" in r and r["hang"].get("ambiguous"))]
        lost = [r for r in ended_by_loss if r.get("attempt") == attempt]
        if said:
            failure = "; ".join(r["reason"] if "hang" in r or "node_lost" in r else f"rank {r['rank']} {r['reason']}"
                                for r in said if r.get("root_cause", True))
            if lost and not any("node_lost" in r for r in said):  # its ranks failed first ("Connection reset by peer")
                failure = "; ".join(f"node {r['node_rank']} ({r['address']}) stopped responding" for r in lost) \
                    + f" (first error: {failure})"
            elif not lost:
                failure = _with_nodes_named(failure, node_addresses)  # a peer gone too briefly to be called lost
        else:
            failure = "; ".join(f"rank {lg.rank} {lg.reason}" for lg in group if lg.status == "failed" and lg.reason) or None
        stopped = stops.get(attempt) or ("stopped (SIGTERM)" if group and all(lg.status == "stopped" for lg in group)
                                         else None)
        if stopped is not None and not said:
            failure = None  # (its ranks' SIGTERMException is how a requested stop ends, not what went wrong)
        if not group:
            if attempt not in started:
                continue
            end = max([r["time"] for r in said] + [started[attempt]])
            infos.append(AttemptInfo(attempt, started[attempt], end, [], None, None, attempt in finished and not said,
                                     failure, stopped))
            continue
        steps = [s for lg in group for s in _train_steps(lg)]
        infos.append(
            AttemptInfo(
                attempt=attempt,
                start=min(e["start"] for lg in group for e in lg.events),
                end=max(e["end"] for lg in group for e in lg.events),
                ranks=sorted(lg.rank for lg in group),
                first_step=min(steps) if steps else None,
                last_step=max(steps) if steps else None,
                # A rank that said "finished" (its fit ended) in an attempt the launcher then stopped or saw fail
                # (a hang after fit, a crash at exit) did not finish the attempt.
                completed=not said and (any(lg.status == "finished" for lg in group) or attempt in finished),
                failure=failure,
                stopped=stopped,
            )
        )
    return infos


def summarize_run_dir(run_dir: str | os.PathLike, now: float | None = None) -> Summary:
    return summarize(read_ledger(run_dir), now=now, launcher=read_launcher_records(run_dir))
