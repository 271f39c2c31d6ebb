"""What the operating system says about a process: alive, started when, in which state, how busy, whose child.

One reader of ``/proc`` for the package: directory ownership (is the owner alive?), the
launcher's lifeline and sweeper (which processes belong to a job?) and the hang watch (is a
silent rank working?) all ask here. Standard library only: ``durable`` is the foundation.

Why ``/proc`` and not ``psutil``: the pinned set has no ``psutil``, and these few reads are all
that is needed; where ``/proc`` is missing (not Linux) liveness falls back to ``kill(pid, 0)`` and
the rest answers ``None``, which callers take as "no evidence".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Stat:
    """The fields of ``/proc/PID/stat`` (stat(5)) the package reads."""

    state: str  # R running, S sleeping, D disk wait, T stopped, t traced, Z zombie, ...
    ppid: int
    pgrp: int
    cpu_ticks: int  # utime + stime of every thread of the process
    start_ticks: int  # clock ticks after boot at which it started


def read_stat(pid: int) -> Stat | None:
    """``/proc/PID/stat`` parsed, or ``None`` (no such process, or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
        return Stat(fields[0], int(fields[1]), int(fields[2]), int(fields[11]) + int(fields[12]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot; ``None`` where unknown."""
    stat = read_stat(pid)
    return stat.start_ticks if stat else None


def process_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether ``pid`` runs on this host and, if ``start_ticks`` is given, is the process that started then.

    A zombie (dead, not yet reaped by its parent) is not alive; neither is a newer process that
    reuses the pid.
    """
    if pid <= 0:
        return False
    stat = read_stat(pid)
    if stat is not None:
        return stat.state not in ("Z", "X", "x") and (start_ticks is None or stat.start_ticks == start_ticks)
    if os.path.isdir("/proc/self"):
        return False  # /proc exists and has no such pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def children(pid: int) -> list[int]:
    """Direct children of ``pid``: ``/proc/PID/task/*/children`` (CONFIG_PROC_CHILDREN), else a scan of ``/proc``."""
    tasks = Path(f"/proc/{pid}/task")
    found: list[int] = []
    try:
        for task in tasks.iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
        return found
    except FileNotFoundError:
        if not tasks.exists():
            return []  # the process is gone
    except (OSError, ValueError):
        pass
    return [p for p in _all_pids() if (stat := read_stat(p)) is not None and stat.ppid == pid]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its children, theirs, ...), ``pid`` excluded."""
    seen: list[int] = []
    todo = children(pid)
    while todo:
        child = todo.pop()
        if child not in seen:
            seen.append(child)
            todo += children(child)
    return seen


@dataclass(frozen=True)
class TreeSample:
    """A process and everything below it, read at one moment: how much CPU and I/O it has used so far."""

    cpu_s: float  # CPU seconds of the process tree (every thread, user and system)
    io_bytes: int  # bytes read and written through system calls (``rchar + wchar``), files, pipes and sockets alike
    state: str  # the main process's state
    pids: int  # processes in the tree


def sample_tree(pid: int) -> TreeSample | None:
    """CPU and I/O counters of ``pid`` and its descendants; ``None`` if ``pid`` is gone or there is no ``/proc``.

    A descendant that exited between two samples takes its counters with it, so callers compare
    samples for growth and treat a drop as "no evidence", never as work.
    """
    root = read_stat(pid)
    if root is None:
        return None
    cpu, io = root.cpu_ticks, _io_bytes(pid)
    tree = descendants(pid)
    for child in tree:
        stat = read_stat(child)
        if stat is not None:
            cpu += stat.cpu_ticks
            io += _io_bytes(child)
    return TreeSample(cpu / _CLOCK_TICKS, io, root.state, 1 + len(tree))


def _io_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/io", encoding="ascii") as f:
            counters = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        return int(counters.get("rchar", 0)) + int(counters.get("wchar", 0))
    except (OSError, ValueError):
        return 0  # not readable (another user's process, or no task I/O accounting): no evidence


def processes_with_env(name: str, value: str) -> list[int]:
    """Processes whose environment, as they were started, has ``name=value`` (this process excluded).

    ``/proc/PID/environ`` is the environment a process was exec'd or forked with: every process
    a job starts inherits it, whatever starts it (fork, spawn, a subprocess, a grandchild), unless
    it clears that variable itself.
    """
    needle = f"{name}={value}".encode()
    me = os.getpid()
    found = []
    for pid in _all_pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            continue
    return found


def command_line(pid: int) -> str:
    """``/proc/PID/cmdline`` with its arguments joined by spaces ("" when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _all_pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


__all__ = ["Stat", "TreeSample", "children", "command_line", "descendants", "process_alive", "process_start_ticks",
           "processes_with_env", "read_stat", "sample_tree"]
