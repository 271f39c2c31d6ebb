"""Nothing a job started outlives its launcher: the sweeper, on real processes started every way a job starts them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import clean_env

from lightning_ett.durable.procfs import process_alive
from lightning_ett.lifecycle.sweeper import kill_process_groups, lead_process_group

# A stand-in for the launcher: a Sweeper, then a worker started as the launcher starts its forkserver and its
# `--no-preload` workers (an interpreter of its own); the worker forks a child (a DataLoader worker) and spawns an
# interpreter (a publisher) that starts a grandchild in a session of its own (a user's daemon). Every process
# writes its pid; the launcher then waits to be SIGKILLed.
WORKER = """
import multiprocessing as mp, os, subprocess, sys, time
out = sys.argv[1]
def note(name):
    open(os.path.join(out, name), "w").write(str(os.getpid()))
def sleep_forever(name):
    note(name)
    time.sleep(600)
GRANDCHILD = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
note("worker")
mp.get_context("fork").Process(target=sleep_forever, args=("forked",)).start()
subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                  f"subprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}, sys.argv[1]], start_new_session=True); "
                  "time.sleep(600)", os.path.join(out, "grandchild")])
time.sleep(600)
"""
LAUNCHER = """
import os, subprocess, sys, time
from lightning_ett.instrument.environment import launch_scratch_dir
from lightning_ett.lifecycle.sweeper import Sweeper
sweeper = Sweeper()
launch_scratch_dir(sweeper.token).mkdir()
open(os.path.join(sys.argv[1], "scratch"), "w").write(str(launch_scratch_dir(sweeper.token)))
subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]])
open(os.path.join(sys.argv[1], "launcher"), "w").write(str(os.getpid()))
time.sleep(600)
"""


def test_a_sigkilled_launcher_leaves_nothing_its_job_started(tmp_path: Path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), WORKER], env=clean_env(),
                                start_new_session=True)
    names = ("launcher", "worker", "forked", "grandchild")
    try:
        deadline = time.time() + 30
        while not all((tmp_path / n).is_file() and (tmp_path / n).read_text() for n in names) and time.time() < deadline:
            time.sleep(0.05)
        pids = {n: int((tmp_path / n).read_text()) for n in names}
        assert all(process_alive(p) for p in pids.values())
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + 10
        while any(process_alive(p) for p in pids.values()) and time.time() < deadline:
            time.sleep(0.05)
        assert not [n for n, p in pids.items() if process_alive(p)], "alive 10 s after the launcher's SIGKILL"
        scratch = Path((tmp_path / "scratch").read_text())
        deadline = time.time() + 5
        while scratch.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert not scratch.exists()  # the launch's named pipes go with it
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)


def test_stopping_a_worker_stops_the_processes_in_its_group():
    code = ("import os, subprocess, sys, time\n"
            "from lightning_ett.lifecycle.sweeper import lead_process_group\n"
            "lead_process_group()\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "print(os.getpgrp(), child.pid, flush=True)\n"
            "time.sleep(600)")
    worker = subprocess.Popen([sys.executable, "-c", code], env=clean_env(), stdout=subprocess.PIPE, text=True)
    group, child = map(int, worker.stdout.readline().split())
    try:
        assert group == worker.pid  # it leads its own group, and its child is in it
        kill_process_groups([worker.pid])
        worker.wait(timeout=10)
        deadline = time.time() + 10
        while process_alive(child) and time.time() < deadline:
            time.sleep(0.05)
        assert not process_alive(child)
    finally:
        worker.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    lead_process_group()  # a no-op in a process that cannot (pytest's own): no error
