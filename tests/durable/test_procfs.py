"""What /proc says about real processes: a tree's CPU and I/O, its descendants, a job's processes by environment."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import clean_env

from lightning_ett.durable.procfs import descendants, processes_with_env, read_stat, sample_tree

# A parent that sleeps and a child that computes: the work is the tree's, not the parent's.
TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time\\nend = time.monotonic() + 30\\nwhile time.monotonic() < end: pass"])
print(child.pid, flush=True)
time.sleep(30)
"""


def test_a_tree_that_works_in_a_child_uses_cpu_and_an_idle_one_does_not():
    busy = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        child = int(busy.stdout.readline())
        time.sleep(0.5)  # past both interpreters' start
        assert descendants(busy.pid) == [child] and descendants(child) == []
        before = {p.pid: sample_tree(p.pid) for p in (busy, idle)}
        time.sleep(1.0)
        after = {p.pid: sample_tree(p.pid) for p in (busy, idle)}
        used = {pid: after[pid].cpu_s - before[pid].cpu_s for pid in after}  # type: ignore[union-attr]
        assert used[busy.pid] > 0.3, used  # the child's work counts for the tree (2 cores, one of them the child's)
        assert used[idle.pid] < 0.05, used
        assert after[busy.pid].pids == 2 and after[busy.pid].state == "S"  # the parent itself sleeps
        stat = read_stat(child)
        assert stat is not None and stat.ppid == busy.pid and stat.state == "R"
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
    assert sample_tree(idle.pid) is None  # gone: no evidence


def test_processes_are_found_by_what_their_environment_carried_at_start():
    marked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                              env=clean_env(LIGHTNING_ETT_TEST_MARK="found-me"))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=clean_env())
    try:
        deadline = time.time() + 10
        while marked.pid not in processes_with_env("LIGHTNING_ETT_TEST_MARK", "found-me") and time.time() < deadline:
            time.sleep(0.05)
        found = processes_with_env("LIGHTNING_ETT_TEST_MARK", "found-me")
        assert marked.pid in found and other.pid not in found
        assert processes_with_env("LIGHTNING_ETT_TEST_MARK", "found") == []  # the whole value, not a prefix
    finally:
        for p in (marked, other):
            p.kill()
            p.wait()
