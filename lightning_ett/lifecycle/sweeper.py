"""Nothing a job started outlives it: process groups stopped whole, and a sweeper for when the launcher dies.

Why: the lifeline (:mod:`lightning_ett.lifecycle.lifeline`) makes the forkserver and the workers
die with ``lightning run``'s launcher, through the kernel's parent-death signal. That signal reaches
only the processes that asked for it. What a worker starts — DataLoader workers (``num_workers > 0``,
persistent or not), ModelPublisher's process, a user's subprocess, their children — outlived it:
a DataLoader worker stuck in ``__getitem__``, often the hang itself, never reaches the check that
would end it, and kept the host's memory and the job's files.

Two mechanisms, for two moments:

* **Between attempts** every worker leads its own process group (forked workers call
  :func:`lead_process_group`; torch starts ``--no-preload`` workers in a session of their own), so
  everything it started is in that group unless it left it. The hang watch stops a hung group by
  process group (:func:`kill_process_groups`, while the workers live); after every stop of the worker
  group the agent kills what is left of the launch in those groups, or orphaned (:func:`sweep_attempt`,
  by token, so that a pid reused by an unrelated process is never hit).
* **When the launcher dies**, even by SIGKILL, the sweeper — a small process the launcher starts, in a
  session of its own, holding the read end of a pipe whose only writer is the launcher — reads
  end-of-file and SIGKILLs every process whose environment carries this launch's token
  (:data:`~lightning_ett.instrument.environment.ENV_LAUNCH_TOKEN`). Every process the job starts
  inherits that variable, however it is started. A process meant to outlive the job must drop it from its
  environment. At a normal end the launcher closes the pipe itself, so leftovers are swept then too; the
  launch's scratch directory (the hang watch's named pipes) goes last.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

from lightning_ett.durable.procfs import command_line, processes_with_env, read_stat
from lightning_ett.instrument.environment import ENV_LAUNCH_TOKEN, launch_scratch_dir

#: How long a sweep goes on finding new processes (a forkserver may fork while it is being swept).
SWEEP_S = 5.0


def lead_process_group() -> None:
    """Make this process the leader of a new process group (a no-op where it already leads one or cannot)."""
    try:
        if os.getpgrp() != os.getpid():
            os.setpgid(0, 0)
    except OSError:
        pass  # a session leader cannot change its group; it already leads one


def kill_process_groups(pids: list[int], sig: signal.Signals = signal.SIGKILL) -> None:
    """Signal the process group each of ``pids`` leads (its descendants in it too), and each pid itself."""
    for pid in pids:
        for send in (os.killpg, os.kill):
            try:
                send(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # gone, or not a group leader (killpg) / not ours


class Sweeper:
    """The launcher's handle on its sweeper process (see the module docstring)."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        os.environ[ENV_LAUNCH_TOKEN] = self.token  # set before anything of the job starts: all of it inherits it
        # Only this process may hold the write end: not inherited across exec (non-inheritable), and closed in any
        # child forked from here (a fork copies every descriptor).
        read_end, self._write_end = os.pipe()
        os.register_at_fork(after_in_child=self._close_write_end)
        self._process = subprocess.Popen([sys.executable, "-m", "lightning_ett.lifecycle.sweeper", self.token],
                                         stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True)
        os.close(read_end)

    def _close_write_end(self) -> None:
        if self._write_end >= 0:
            os.close(self._write_end)
            self._write_end = -1

    def close(self, timeout_s: float = SWEEP_S + 2.0) -> None:
        """The job is over: the sweeper sweeps what is left and the launch's scratch directory, then exits (waited for
        up to ``timeout_s``)."""
        self._close_write_end()
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


#: Left to end by itself: multiprocessing's resource tracker unlinks the semaphores and shared memory the job's
#: processes leaked once the last of them is gone (it exits then); killing it leaked them in /dev/shm.
_LEAVE = "multiprocessing.resource_tracker"


def _ours(token: str) -> set[int]:
    """The processes of this launch, but for those that end by themselves once it is over (:data:`_LEAVE`)."""
    return {pid for pid in processes_with_env(ENV_LAUNCH_TOKEN, token) if _LEAVE not in command_line(pid)}


def sweep_attempt(token: str, groups: set[int], within_s: float = SWEEP_S) -> int:
    """After an attempt's workers stopped: SIGKILL what they left behind, and only that.

    A process of this launch (its environment has the token: never an unrelated process that reuses a pid)
    that is in one of ``groups`` (the stopped workers' process groups), or that is orphaned (its parent is
    neither this launcher nor another process of the launch: a daemon a worker started and left). The
    launcher's own children (forkserver, W&B service, sweeper) and theirs stay.
    """
    launcher, killed = os.getpid(), 0
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        ours = _ours(token)
        left = [pid for pid in ours if (stat := read_stat(pid)) is not None and stat.state not in ("Z", "X")
                and (stat.pgrp in groups or (stat.ppid != launcher and stat.ppid not in ours))]
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
    return killed


def sweep(token: str, within_s: float = SWEEP_S) -> int:
    """SIGKILL every process whose environment has this launch's token, until none is left; returns how many."""
    killed: set[int] = set()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = sorted(_ours(token))
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        if not found:
            break
        time.sleep(0.05)
    return len(killed)


def main(argv: list[str]) -> None:
    """The sweeper process: wait for the launcher's end (end-of-file on stdin), then sweep."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # Ctrl-C or a scheduler's SIGTERM to the job must not stop the sweep
    while os.read(0, 4096):
        pass  # the launcher never writes: only its end returns here
    sweep(argv[0])
    shutil.rmtree(launch_scratch_dir(argv[0]), ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
