"""Each rank's collectives as torch's flight recorder saw them: per process group, the last one enqueued and completed.

Why: a rank's Python stack cannot tell a rank that waits for a peer from one that is stuck on its
own. NCCL collectives are asynchronous, so a GPU rank waiting on a peer blocks later, at a host
sync (``.item()``, ``.cpu()``), outside any collective frame; its host step count runs ahead of
its GPU. torch's flight recorder (on by default, ``TORCH_FR_BUFFER_SIZE`` /
``TORCH_NCCL_TRACE_BUFFER_SIZE`` entries, 2000) numbers every collective of every process
group on every rank, for gloo and NCCL alike, and says which one each rank enqueued and
completed last. A rank whose peers wait for collective *n* of a group that it has not even
enqueued is the one they wait for, whatever its stack shows.

torch can only dump the recorder from inside the rank (``_dump_fr_trace``, ``_dump_nccl_trace``).
So under ``lightning run``'s hang watch each worker serves dumps on request (:func:`serve`): a
daemon thread blocks on a named pipe in a local directory of the launch, and on each request writes
the recorder's per-group status to a file beside it. The thread costs the training path nothing (it
sleeps in ``open``), and it answers while the main thread is blocked in a collective or
``time.sleep`` (both release the GIL). A stopped process cannot answer: the watch takes that as
evidence of its own.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ett.instrument.environment import ENV_ATTEMPT, ENV_LAUNCH_TOKEN, launch_scratch_dir


def dump_dir(token: str, attempt: int) -> Path:
    """Where one attempt's ranks serve their dumps: local to the host (named pipes do not cross a network filesystem)."""
    return launch_scratch_dir(token) / f"attempt-{attempt:04d}"


def _fifo(token: str, attempt: int, rank: int) -> Path:
    return dump_dir(token, attempt) / f"rank-{rank:05d}.fifo"


def _answer(token: str, attempt: int, rank: int) -> Path:
    return dump_dir(token, attempt) / f"rank-{rank:05d}.pkl"


@dataclass(frozen=True)
class GroupStatus:
    """One process group on one rank: the sequence number of the last collective it enqueued and completed."""

    enqueued: int
    completed: int
    pending: str | None = None  # the operation of its first collective not completed (e.g. "gloo:barrier")

    @property
    def waiting(self) -> bool:
        return self.enqueued > self.completed


@dataclass(frozen=True)
class Collectives:
    """One rank's flight-recorder status: ``group -> GroupStatus`` (groups keyed alike on every rank)."""

    groups: dict[str, GroupStatus]

    @property
    def waiting(self) -> bool:
        """It has enqueued a collective that has not completed."""
        return any(g.waiting for g in self.groups.values())

    @property
    def waiting_on_gpu(self) -> bool:
        """A NCCL collective of it is pending: its host, if it waits for it, spins at 100 % of a core."""
        return any(g.waiting for key, g in self.groups.items() if key.startswith("nccl/"))

    def completed_since(self, earlier: Collectives) -> bool:
        """A collective of some group completed between ``earlier`` and this status: the rank progressed."""
        return any(g.completed > earlier.groups[k].completed for k, g in self.groups.items() if k in earlier.groups)


def parse_status(dump: dict[str, Any]) -> Collectives:
    """A rank's answer (:meth:`_Recorders.status`): ``{"groups": {key: {"enqueued": n, "completed": m}}}``."""
    groups = {}
    for key, status in dict(dump.get("groups") or {}).items():
        try:
            groups[str(key)] = GroupStatus(int(status["enqueued"]), int(status["completed"]), status.get("pending"))
        except (KeyError, TypeError, ValueError):
            continue
    return Collectives(groups)


def group_statuses(recorder: str, dump: dict[str, Any], names: dict[int, str] | None = None) -> dict[str, dict[str, Any]]:
    """One of torch's recorder dumps as ``"recorder/group name" -> {"enqueued", "completed"}``.

    torch keys ``pg_status`` by each backend's process-local uid, which differs between ranks (a rank
    outside a subgroup creates no backend for it, so its later groups get other uids), and the gloo and
    NCCL recorders number their groups independently. The group's *name* is the same on every rank
    (torch's own flight-recorder analysis matches ranks by it); the dump's entries map uid to name, and
    ``names`` keeps what earlier dumps mapped (it is updated). A group whose uid never appeared in an
    entry is left out: it has done no collective that the recorder still holds.
    """
    names = {} if names is None else names
    names.update({int(e["pg_id"]): str(e["process_group"][0]) for e in dump.get("entries") or []
                  if "pg_id" in e and e.get("process_group")})
    out: dict[str, dict[str, Any]] = {}
    for uid, status in dict(dump.get("pg_status") or {}).items():
        name = names.get(int(uid)) if str(uid).lstrip("-").isdigit() else None
        if name is None:
            continue
        try:
            out[f"{recorder}/{name}"] = {"enqueued": int(status["last_enqueued_collective"]),
                                         "completed": int(status["last_completed_collective"])}
        except (KeyError, TypeError, ValueError):
            continue
    return out


class _Recorders:
    """This process's flight recorders (gloo's and, on CUDA builds, NCCL's), read the cheap way when possible.

    A status-only dump costs microseconds; the dump with entries, which maps a group's uid to its name, costs
    tens of milliseconds (its 2000 entries): it is taken only when a uid appears that is not mapped yet.
    """

    def __init__(self) -> None:
        self._names: dict[str, dict[int, str]] = {"gloo": {}, "nccl": {}}

    def status(self) -> bytes:
        torch = sys.modules.get("torch")
        groups: dict[str, dict[str, Any]] = {}
        if torch is not None and torch.distributed.is_available():
            from torch._C import _distributed_c10d as c10d

            for recorder, name in (("gloo", "_dump_fr_trace"), ("nccl", "_dump_nccl_trace")):
                dump = getattr(c10d, name, None)
                # No recorder for a backend (NCCL not initialized, an older torch): no evidence from it.
                with contextlib.suppress(Exception):
                    if dump is not None:
                        groups.update(self._groups(recorder, dump))
        return pickle.dumps({"groups": groups, "time": time.time()})

    def _groups(self, recorder: str, dump: Any) -> dict[str, dict[str, Any]]:
        cheap = pickle.loads(dump(False, False, False))
        names = self._names[recorder]
        status = dict(cheap.get("pg_status") or {})
        if any(int(uid) not in names for uid in status if str(uid).lstrip("-").isdigit()):
            groups = group_statuses(recorder, pickle.loads(dump(True, False, False)), names)
        else:
            groups = group_statuses(recorder, cheap, names)
        if any(g["enqueued"] > g["completed"] for g in groups.values()):  # which operation each waits in
            active = pickle.loads(dump(True, False, True)).get("entries") or []
            ops = {(names.get(int(e["pg_id"])), int(e["collective_seq_id"])): str(e.get("profiling_name"))
                   for e in active if "pg_id" in e and "collective_seq_id" in e}
            for key, g in groups.items():
                g["pending"] = ops.get((key.split("/", 1)[1], g["completed"] + 1))
        return groups


def serve(rank: int) -> bool:
    """Worker side: answer the watch's dump requests from a daemon thread (idempotent); False outside ``lightning run``."""
    token, attempt = os.environ.get(ENV_LAUNCH_TOKEN), os.environ.get(ENV_ATTEMPT, "")
    if not token or not attempt.isdigit():
        return False
    fifo, answer = _fifo(token, int(attempt), rank), _answer(token, int(attempt), rank)
    if any(t.name == "ett-flight-recorder" for t in threading.enumerate()):
        return True
    try:
        fifo.parent.mkdir(parents=True, exist_ok=True)
        if not fifo.exists():
            os.mkfifo(fifo)
    except OSError:
        return False  # no named pipes here: the watch goes on with its other evidence
    threading.Thread(target=_serve_forever, args=(fifo, answer), name="ett-flight-recorder", daemon=True).start()
    return True


def _serve_forever(fifo: Path, answer: Path) -> None:
    recorders = _Recorders()
    while True:
        try:
            with open(fifo, "rb") as request:  # blocks until the watch opens it for writing
                request.read()
            part = answer.with_name(answer.name + ".part")
            part.write_bytes(recorders.status())
            os.replace(part, answer)  # whole or not at all (a scratch file: no fsync)
        except OSError:
            time.sleep(1.0)  # the launch's directory went away (the job is ending)


def request(token: str, attempt: int, ranks: list[int], timeout_s: float = 3.0) -> dict[int, Collectives | None]:
    """Watch side: ask each rank for its status and wait up to ``timeout_s`` for the answers (``None``: no answer)."""
    asked: dict[int, float] = {}
    for rank in ranks:
        try:
            fd = os.open(_fifo(token, attempt, rank), os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: no thread serves it
        except OSError:
            continue
        asked[rank] = _mtime(_answer(token, attempt, rank))
        try:
            os.write(fd, b"?")
        except OSError:
            asked.pop(rank)
        finally:
            os.close(fd)
    answers: dict[int, Collectives | None] = dict.fromkeys(ranks)
    deadline = time.monotonic() + timeout_s
    while asked and time.monotonic() < deadline:
        for rank, before in list(asked.items()):
            path = _answer(token, attempt, rank)
            if _mtime(path) > before:
                try:
                    answers[rank] = parse_status(pickle.loads(path.read_bytes()))
                    del asked[rank]
                except (OSError, pickle.UnpicklingError, EOFError):
                    pass  # replaced while read: read again
        time.sleep(0.02)
    return answers


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime_ns / 1e9
    except OSError:
        return 0.0


def behind(statuses: dict[int, Collectives]) -> tuple[int, str] | None:
    """The one rank the others wait for, by collective sequence numbers, and the evidence; ``None`` if not one.

    In a group where some rank waits for collective *n* (its first not completed), a rank that has
    not enqueued *n* holds it up. Every group must point at the same single rank: a deadlock across
    groups (each rank waiting in a group the other never joins) points at both, and is left to the
    other evidence.
    """
    named: dict[int, str] = {}
    keys = {k for s in statuses.values() for k in s.groups}
    for key in sorted(keys):
        in_group = {r: s.groups[key] for r, s in statuses.items() if key in s.groups}
        waiting = {r: g for r, g in in_group.items() if g.waiting}
        if not waiting or len(in_group) < 2:
            continue
        wanted = min(g.completed for g in waiting.values()) + 1
        holders = sorted(r for r, g in in_group.items() if g.enqueued < wanted)
        for r in holders:
            named.setdefault(r, f"flight recorder: in process group {key}, rank(s) {_list(sorted(waiting))} wait for "
                                f"collective #{wanted}, which rank {r} has not enqueued (its last: "
                                f"#{in_group[r].enqueued})")
    if len(named) != 1:
        return None
    (rank, evidence), = named.items()
    return rank, evidence


def mismatch(statuses: dict[int, Collectives]) -> tuple[int | None, str] | None:
    """Ranks that wait for the same collective of a group but called different operations (a collective only some
    ranks call): the evidence, and the rank whose operation differs from all the others' (``None`` when no majority
    says which, as with two ranks)."""
    keys = sorted({k for s in statuses.values() for k in s.groups})
    for key in keys:
        waiting = {r: s.groups[key] for r, s in statuses.items() if key in s.groups and s.groups[key].waiting}
        by_seq: dict[int, dict[int, str]] = {}
        for rank, g in waiting.items():
            if g.pending:
                by_seq.setdefault(g.completed + 1, {})[rank] = g.pending
        for seq, ops in sorted(by_seq.items()):
            if len(set(ops.values())) < 2:
                continue
            called = ", ".join(f"rank {r} {op}" for r, op in sorted(ops.items()))
            counts = {op: sum(1 for o in ops.values() if o == op) for op in set(ops.values())}
            odd = [r for r, op in ops.items() if counts[op] == 1 and len(ops) > 2 and max(counts.values()) > 1]
            evidence = (f"flight recorder: ranks wait for collective #{seq} of process group {key} but called "
                        f"different ones ({called}): a collective only some ranks call")
            return (odd[0] if len(odd) == 1 else None), evidence
    return None


def _list(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


