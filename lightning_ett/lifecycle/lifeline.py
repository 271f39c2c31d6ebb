"""Make this process die with ``lightning run``'s launcher.

Why: a launcher killed with SIGKILL (the OOM killer, a scheduler) runs no cleanup. Its workers —
forked from the node's forkserver, or started by torch as subprocesses — kept training
without it, wrote checkpoints beside the next launch of the same job, and then waited forever
for the dead agent, holding their GPUs.

The launcher exports its pid (``LIGHTNING_ETT_LAUNCHER_PID``); without it every call here is a
no-op. Two mechanisms:

* **Linux: a parent-death signal**, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills this
  process when its parent dies. It fires when the parent *thread* that forked it ends, so it is
  set only where that thread lives as long as the process: the launcher's main thread (its
  forkserver, torch's ``--no-preload`` subprocesses) or the forkserver's single thread (forked
  workers). The parent is checked again right after: one that died before the call would
  never send the signal.
* **A watchdog thread** (daemon) that looks at the launcher every :data:`POLL_S` seconds and
  SIGKILLs this process once it is gone, a zombie, or its pid belongs to a newer process (its
  start time is compared). The only mechanism where ``prctl`` is missing; in addition to it in the
  workers. The forkserver gets none when ``prctl`` works: a process that forks should not have
  threads.

Both are armed once per process (a forked child arms its own).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

from lightning_ett.durable.procfs import process_alive, process_start_ticks
from lightning_ett.instrument.environment import ENV_LAUNCHER_PID

#: Seconds between the watchdog's looks at the launcher.
POLL_S = 1.0
_PR_SET_PDEATHSIG = 1
_armed_in: int | None = None  # the pid of the process that armed it (a forked child is not armed)


def launcher_pid() -> int | None:
    """The pid of the ``lightning run`` launcher this process belongs to, if any."""
    value = os.environ.get(ENV_LAUNCHER_PID, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def hold_on_to_launcher(forked_by_server: bool = False, forks: bool = False) -> bool:
    """Die (SIGKILL) when the launcher dies; True if armed. Idempotent; a no-op outside ``lightning run``.

    Args:
        forked_by_server: this process was forked by the node's forkserver (a single thread that
            dies with the launcher): its death may signal this one.
        forks: this process forks workers (the forkserver): no watchdog thread where the
            parent-death signal works.
    """
    global _armed_in
    launcher = launcher_pid()
    me = os.getpid()
    if launcher is None or launcher == me or _armed_in == me:
        return False
    _armed_in = me
    launcher_start = process_start_ticks(launcher)
    parent = os.getppid()
    direct = parent == launcher
    signalled = (direct or forked_by_server) and _set_parent_death_signal()
    if signalled and os.getppid() != parent:
        _die()  # the parent died before the signal was armed
    if not _alive(launcher, launcher_start, direct):
        _die()
    if not (signalled and forks):
        threading.Thread(target=_watch, args=(launcher, launcher_start, direct), name="ett-lifeline",
                         daemon=True).start()
    return True


def _set_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _alive(launcher: int, start: int | None, direct: bool) -> bool:
    if direct and os.getppid() != launcher:
        return False  # orphaned: reparented the moment the launcher died, zombie or not
    return process_alive(launcher, start)


def _watch(launcher: int, start: int | None, direct: bool) -> None:
    while _alive(launcher, start, direct):
        time.sleep(POLL_S)
    _die()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["POLL_S", "hold_on_to_launcher", "launcher_pid"]
