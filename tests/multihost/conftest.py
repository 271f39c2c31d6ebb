"""Fixtures for two-host jobs: ``two_hosts`` (the namespaces) and ``TwoHostJob`` (one launcher per host).

Any test may use ``two_hosts``; it skips, saying why, on a machine that cannot create network
namespaces (not root). CI runs as root and runs these tests.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from conftest import LIGHTNING, REPO, clean_env

from tests.multihost.hosts import TwoHosts, namespaces_unavailable

MAIN_PORT = "29500"
_WHY_NOT = namespaces_unavailable()


@pytest.fixture(params=["loopback"])
def two_hosts(request: pytest.FixtureRequest) -> Iterator[TwoHosts]:
    """Two hosts; parametrize indirectly with ``"per_host"`` for hostnames of their own."""
    if _WHY_NOT is not None:
        pytest.skip(f"two-host tests need network namespaces: {_WHY_NOT}")
    hosts = TwoHosts(tag=f"{os.getpid() % 100000}", hostnames=request.param)
    try:
        hosts.create()
        yield hosts
    finally:
        hosts.destroy()


class TwoHostJob:
    """``lightning run --num-nodes 2`` on each host, sharing ``tmp/run`` (the run directory) as on a shared filesystem."""

    def __init__(self, hosts: TwoHosts, tmp: Path, script: Sequence[str], flags: Sequence[str] = (), **env: str) -> None:
        self.hosts, self.tmp, self.script, self.flags, self.env = hosts, tmp, list(script), list(flags), env
        self.run_dir = tmp / "run"
        self.procs: dict[int, list] = {0: [], 1: []}
        self.started = time.monotonic()

    def argv(self, node: int, flags: Sequence[str] = ()) -> list[str]:
        return [LIGHTNING, "run", "--num-nodes", "2", "--node-rank", str(node), "--devices", "1",
                "--main-address", self.hosts.address(0), "--main-port", MAIN_PORT, "--run-dir", str(self.run_dir),
                *self.flags, *flags, *self.script]

    def log(self, node: int) -> Path:
        return self.tmp / f"node{node}.log"

    def start(self, node: int, flags: Sequence[str] = (), spare: bool = False) -> None:
        """Start node ``node``'s launcher (again: a replacement appends to the same log; ``spare``: on another
        machine, in the per-host set-up)."""
        self.procs[node].append(self.hosts.start(node, self.argv(node, flags), self.log(node), clean_env(**self.env),
                                                 cwd=self.tmp, spare=spare))

    def start_both(self) -> TwoHostJob:
        for node in (0, 1):
            self.start(node)
        return self

    def output(self, node: int) -> str:
        return self.log(node).read_text(errors="replace") if self.log(node).exists() else ""

    def wait_for_text(self, node: int, pattern: str, timeout: float) -> float:
        """Seconds until ``pattern`` (a regex) appears in node ``node``'s output."""
        start = time.monotonic()
        while not re.search(pattern, self.output(node)):
            if time.monotonic() - start > timeout:
                raise AssertionError(f"node {node} never printed {pattern!r} in {timeout:.0f} s:\n"
                                     f"{self.output(node)[-4000:]}")
            time.sleep(0.2)
        return time.monotonic() - start

    def wait_for_steps(self, steps: int, timeout: float = 120) -> None:
        """Until rank 0 recorded ``steps`` training steps (its ledger)."""
        deadline = time.monotonic() + timeout
        while self.train_steps(rank=0) < steps:
            if time.monotonic() > deadline:
                raise AssertionError(f"rank 0 did not reach {steps} steps in {timeout:.0f} s:\n{self.output(0)[-4000:]}")
            time.sleep(0.2)

    def train_steps(self, rank: int) -> int:
        count = 0
        for path in self.run_dir.glob(f"ledger/attempt-*/rank-{rank:05d}.jsonl"):
            # one "event" line per finished step (a "begin" line precedes it while the hang watch is on)
            count += path.read_text(errors="replace").count('"kind":"event","phase":"train"')
        return count

    def wait(self, node: int, timeout: float) -> int:
        """The exit code of node ``node``'s newest launcher."""
        proc = self.procs[node][-1]
        try:
            return proc.wait(timeout=timeout)
        except Exception as err:
            raise AssertionError(f"node {node}'s launcher still running after {timeout:.0f} s:\n"
                                 f"{self.output(node)[-4000:]}") from err


ETT_JOB = str(REPO / "tests" / "scripts" / "ett_job.py")
