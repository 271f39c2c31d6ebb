"""Append-only, crash-safe event ledger: one JSON-lines file per rank and attempt.

Layout: ``RUN_DIR/ledger/attempt-0003/rank-00001.jsonl``. Each record is written with a
single ``os.write`` on an ``O_APPEND`` descriptor, so a SIGKILL loses at most the record
being written, and a reader skips a torn last line. No ``fsync`` per record: the records
must survive the process, not the machine, and an fsync per training step would cost more
than the step on a network filesystem.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LEDGER_DIR = "ledger"
#: The launcher's own records (attempt starts, failures, outcome), one file per node.
LAUNCHER_DIR = "launcher"
_FILE_RE = re.compile(r"attempt-(\d+)/rank-(\d+)\.jsonl$")


def ledger_path(run_dir: Path, attempt: int, rank: int) -> Path:
    return Path(run_dir) / LEDGER_DIR / f"attempt-{attempt:04d}" / f"rank-{rank:05d}.jsonl"


def launcher_ledger_path(run_dir: Path, node_rank: int) -> Path:
    return Path(run_dir) / LEDGER_DIR / LAUNCHER_DIR / f"node-{node_rank:05d}.jsonl"


def read_launcher_records(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every node's launcher records (``launch``, ``attempt``, ``failure``, ``end``, ``suspicion``, ``node_lost``,
    ``node_back``), by time; malformed ones skipped."""
    records = []
    for path in sorted((Path(run_dir) / LEDGER_DIR / LAUNCHER_DIR).glob("node-*.jsonl")):
        records.extend(r for r in _read_records(path) if r is not None and _valid_launcher_record(r))
    return sorted(records, key=lambda r: r["time"])


def recorded_attempts(run_dir: str | os.PathLike) -> list[int]:
    """Numbers of the attempts that have a directory in the ledger (any rank)."""
    found = (re.fullmatch(r"attempt-(\d+)", p.name) for p in (Path(run_dir) / LEDGER_DIR).glob("attempt-*"))
    return sorted(int(m.group(1)) for m in found if m)


def rank_ledger_files(run_dir: Path, rank: int) -> list[Path]:
    return sorted((Path(run_dir) / LEDGER_DIR).glob(f"attempt-*/rank-{rank:05d}.jsonl"))


class LedgerWriter:
    """Appends records to one rank's ledger file for one attempt."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as err:
            raise PermissionError(
                f"lightning-ett cannot write its ledger under {str(self.path.parent)!r} ({err.strerror}). "
                "Pass a writable `run_dir` to ETTMonitor or set LIGHTNING_ETT_RUN_DIR."
            ) from err

    def append(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            return
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class RankLedger:
    """Everything one rank recorded during one attempt."""

    attempt: int
    rank: int
    header: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    status: str | None = None  # "finished" or "failed" once the attempt ended on this rank
    reason: str | None = None  # why it failed, when the rank could tell
    facts: list[dict[str, Any]] = field(default_factory=list)  # see Timeline.fact
    torn_lines: int = 0  # lines skipped: torn by a kill mid-write, or not a valid record


def _number(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float (a hand-edited record)
        return False


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _valid_record(record: dict[str, Any], phases: frozenset[str]) -> bool:
    """Whether a rank's record has the fields of its kind with the right types (else it is skipped and counted)."""
    kind = record.get("kind")
    if kind == "event":
        step = record.get("step")
        return (record.get("phase") in phases and _number(record.get("start")) and _number(record.get("end"))
                and record["end"] >= record["start"] and (step is None or _integer(step)))
    if kind == "header":
        return all(_number(record[k]) for k in ("job_start", "attempt_start", "process_start") if record.get(k) is not None)
    if kind == "status":
        return isinstance(record.get("status"), str) and isinstance(record.get("reason", ""), str)
    if kind == "fact":
        return isinstance(record.get("name"), str) and _number(record.get("time", 0.0))
    if kind == "begin":  # for the hang watch (Timeline.begin); not time
        return record.get("phase") in phases and _number(record.get("time"))
    return False


#: ``suspicion``: the hang watch suspected a hang and found a rank working (no restart; what cleared it).
_LAUNCHER_FIELDS = {"launch": (), "attempt": ("attempt",), "failure": ("attempt", "rank"), "end": (),
                    "suspicion": ("attempt",), "node_lost": ("attempt", "node_rank"), "node_back": ("attempt", "node_rank")}


def _valid_launcher_record(record: dict[str, Any]) -> bool:
    kind = record.get("kind")
    fields = _LAUNCHER_FIELDS.get(kind)  # type: ignore[arg-type]
    reason = record.get("reason", None if kind == "failure" else "")  # a failure must say why
    return (fields is not None and _number(record.get("time")) and all(_integer(record.get(k)) for k in fields)
            and isinstance(reason, str)
            and (kind != "launch" or _number(record.get("job_start", 0.0)))
            and (kind not in ("node_lost", "node_back")
                 or (_number(record.get("since")) and isinstance(record.get("address"), str)))
            and (kind != "failure" or isinstance(record.get("hang", {}), dict)))


def _read_records(path: Path) -> Iterator[dict[str, Any] | None]:
    """Each line's record; ``None`` for a line that is not a JSON object (torn by a kill mid-write, or garbage)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            yield record if isinstance(record, dict) else None


def read_ledger(run_dir: str | os.PathLike, ranks: set[int] | None = None) -> list[RankLedger]:
    """Read the ledgers under ``run_dir`` (every rank, or only ``ranks``), in (attempt, rank) order."""
    root = Path(run_dir) / LEDGER_DIR
    if not root.is_dir():
        raise FileNotFoundError(
            f"No ETT ledger under {str(run_dir)!r}: expected {str(root)!r}. "
            "Is this the run directory of a job that used ETTMonitor?"
        )
    from lightning_ett.instrument.timeline import PHASE_NAMES  # (timeline imports this module)

    phases = frozenset(PHASE_NAMES)
    ledgers = []
    for path in sorted(root.glob("attempt-*/rank-*.jsonl")):
        match = _FILE_RE.search(path.as_posix())
        if match is None or (ranks is not None and int(match.group(2)) not in ranks):
            continue
        ledger = RankLedger(attempt=int(match.group(1)), rank=int(match.group(2)))
        for record in _read_records(path):
            if record is None or not _valid_record(record, phases):
                ledger.torn_lines += 1
            elif record.get("kind") == "header":
                # Later header records amend earlier ones (e.g. a job start learned on resume).
                earlier_start = ledger.header.get("job_start")
                ledger.header.update(record)
                if earlier_start is not None and record.get("job_start") is not None:
                    ledger.header["job_start"] = min(earlier_start, record["job_start"])
            elif record.get("kind") == "event":
                ledger.events.append(record)
            elif record.get("kind") == "fact":
                ledger.facts.append(record)
            elif record.get("kind") == "status":
                ledger.status = record.get("status")
                ledger.reason = record.get("reason")
        ledgers.append(ledger)
    return ledgers


def stopped_attempts(launcher: list[dict[str, Any]]) -> dict[int, str]:
    """Attempts a signal to the launcher stopped (its ``end`` record says ``stopped by ...``), with that reason."""
    stopped, current = {}, None
    for r in launcher:  # by time
        if r.get("kind") == "attempt":
            current = int(r["attempt"])
        elif r.get("kind") == "end" and str(r.get("reason", "")).startswith("stopped by ") and current is not None:
            stopped[current] = str(r["reason"])
    return stopped


def failed_attempts(run_dir: str | os.PathLike, before: int) -> int:
    """How many of the job's attempts numbered below ``before`` ended in a failure.

    An attempt failed if the launcher recorded a failure for it, or if it left rank ledgers
    none of which says ``finished`` or ``stopped`` (a SIGKILL leaves no status at all). An attempt
    stopped on request (Ctrl-C, a scheduler's SIGTERM: it saved where it stopped) is no failure.
    The cadence policy of AsyncCheckpoint divides the job's wall time by this to estimate the
    time between failures.
    """
    launcher = read_launcher_records(run_dir)
    failed = {int(r["attempt"]) for r in launcher if r.get("kind") == "failure" and "attempt" in r}
    failed -= set(stopped_attempts(launcher))
    for attempt in recorded_attempts(run_dir):
        if attempt < before and attempt not in failed:
            files = (Path(run_dir) / LEDGER_DIR / f"attempt-{attempt:04d}").glob("rank-*.jsonl")
            if not any(_ends_finished(f) for f in files):
                failed.add(attempt)
    return len({a for a in failed if a < before})


def _ends_finished(path: Path) -> bool:
    """Whether a rank's ledger says ``finished``: only its tail is read (a ledger holds a record per step)."""
    with open(path, "rb") as f:
        f.seek(max(f.seek(0, os.SEEK_END) - 4096, 0))
        tail = f.read().decode("utf-8", errors="replace").splitlines()
    for line in reversed(tail):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("kind") == "status":
            return record.get("status") in ("finished", "stopped")
    return False
