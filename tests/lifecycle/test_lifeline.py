"""Processes of a `lightning run` job die with its launcher: parent-death signal, and a watchdog beyond it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import clean_env

from lightning_ett.durable.procfs import process_alive
from lightning_ett.lifecycle import lifeline

# A stand-in for the launcher: exports its pid and starts a child (direct) or a child that starts
# the armed grandchild (the watchdog's case: its parent is not the launcher).
LAUNCHER = """
import os, subprocess, sys, time
os.environ["LIGHTNING_ETT_LAUNCHER_PID"] = str(os.getpid())
out, depth = sys.argv[1], int(sys.argv[2])
subprocess.Popen([sys.executable, "-c", sys.argv[3], out, str(depth - 1), sys.argv[3]])
time.sleep(120)
"""
CHILD = """
import os, subprocess, sys, threading, time
out, depth = sys.argv[1], int(sys.argv[2])
if depth > 0:  # a middle process that does not hold on: only its child does
    subprocess.Popen([sys.executable, "-c", sys.argv[3], out, str(depth - 1), sys.argv[3]])
else:
    from lightning_ett.durable.files import atomic_write_text
    from lightning_ett.lifecycle.lifeline import hold_on_to_launcher
    forks = "forks" in out
    armed = hold_on_to_launcher(forks=forks)
    again = hold_on_to_launcher(forks=forks)
    # Atomic: the test polls for the file and must never read it created but not yet written.
    atomic_write_text(os.path.join(out, "armed"), f"{os.getpid()} {armed} {again} {threading.active_count()}")
time.sleep(120)
"""


def _start(out: Path, depth: int) -> tuple[subprocess.Popen, list[str]]:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(out), str(depth), CHILD], env=clean_env(),
                                start_new_session=True)  # its own process group: the test's `finally` ends them all
    deadline = time.time() + 30
    while not (out / "armed").is_file() and time.time() < deadline:
        time.sleep(0.05)
    return launcher, (out / "armed").read_text().split()


@pytest.mark.parametrize(("depth", "name"), [(1, "direct"), (1, "direct-forks"), (2, "grandchild")])
def test_a_process_holding_on_dies_within_seconds_of_a_sigkill_to_the_launcher(tmp_path, depth, name):
    out = tmp_path / name
    out.mkdir()
    launcher, (pid, armed, again, threads) = _start(out, depth)
    pid_ = int(pid)
    try:
        assert (armed, again) == ("True", "False")  # armed once per process
        # The forkserver (it forks) gets no watchdog thread where the parent-death signal works.
        assert threads == ("1" if name == "direct-forks" else "2")
        time.sleep(0.3)
        assert process_alive(pid_)
        launcher.send_signal(signal.SIGKILL)  # left a zombie until reaped below: dead all the same
        deadline = time.time() + 5
        while process_alive(pid_) and time.time() < deadline:
            time.sleep(0.05)
        assert not process_alive(pid_), f"{name}: still alive 5 s after the launcher's SIGKILL"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)  # the middle process of the grandchild case, or any survivor
        launcher.wait()


def test_outside_lightning_run_it_does_nothing(monkeypatch):
    monkeypatch.delenv("LIGHTNING_ETT_LAUNCHER_PID", raising=False)
    assert lifeline.hold_on_to_launcher() is False
    monkeypatch.setenv("LIGHTNING_ETT_LAUNCHER_PID", str(os.getpid()))  # the launcher itself
    assert lifeline.hold_on_to_launcher() is False
    monkeypatch.setenv("LIGHTNING_ETT_LAUNCHER_PID", "not-a-pid")
    assert lifeline.launcher_pid() is None and lifeline.hold_on_to_launcher() is False
