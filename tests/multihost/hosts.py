"""Two "hosts" on one machine: two Linux network namespaces joined by a veth pair, and nothing else.

Each namespace has loopback and one address on the pair; there is no route out of the pair, so
a process there reaches the other host only at that host's address, as on two real machines.
What the two share is this machine's filesystem: the run directory and checkpoints stand for a
shared filesystem. PIDs are shared too (no PID namespace), which the tests use to find and kill
a host's processes, never to talk between hosts.

Hostnames, two set-ups (``hostnames=``):

* ``"loopback"``: both hosts keep this machine's hostname, which ``/etc/hosts`` maps to 127.0.0.1
  here and in many containers: a host that advertises its hostname advertises loopback.
* ``"per_host"``: each host gets its own hostname (a UTS namespace) that resolves, on both hosts,
  to its address on the pair (``ip netns exec`` mounts ``/etc/netns/NAME/hosts`` over ``/etc/hosts``).

Written as a class, not with ``pyroute2``: ``ip`` (iproute2) is what the machines have, and a
handful of its commands is the whole of the set-up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

NETNS_ETC = Path("/etc/netns")


def namespaces_unavailable() -> str | None:
    """Why this machine cannot create the two hosts, or None when it can."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    name = f"ettprobe{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], check=False, capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
    return None


@dataclass
class TwoHosts:
    """Hosts 0 and 1 (namespaces), their addresses on the pair, and the processes started on them."""

    tag: str
    hostnames: str = "loopback"
    subnet: str = "10.231.7"
    names: tuple[str, str] = field(init=False)
    links: tuple[str, str] = field(init=False)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.hostnames not in ("loopback", "per_host"):
            raise ValueError(f"hostnames={self.hostnames!r}: expected 'loopback' or 'per_host'")
        self.names = (f"ett{self.tag}h0", f"ett{self.tag}h1")
        self.links = (f"ett{self.tag}v0", f"ett{self.tag}v1")  # (interface names: at most 15 characters)

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def hostname(self, host: int, spare: bool = False) -> str:
        """``spare``: the name of a machine a scheduler puts in ``host``'s place, with its address (per-host set-up)."""
        return f"ett-host{host}" + ("-spare" if spare else "")

    # ------------------------------------------------------------------ set-up and tear-down
    def create(self) -> None:
        a, b = self.names
        for name in self.names:
            _ip("netns", "add", name)
        _ip("link", "add", self.links[0], "netns", a, "type", "veth", "peer", "name", self.links[1], "netns", b)
        for host, name in enumerate(self.names):
            _ip("-n", name, "addr", "add", f"{self.address(host)}/24", "dev", self.links[host])
            _ip("-n", name, "link", "set", self.links[host], "up")
            _ip("-n", name, "link", "set", "lo", "up")
            if self.hostnames == "per_host":
                etc = NETNS_ETC / name
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
                    f"{self.address(h)} {self.hostname(h)} {self.hostname(h, spare=True)}\n" for h in (0, 1)))

    def destroy(self) -> None:
        """Every process on both hosts, then the namespaces and their files (also after a failed test)."""
        for host in (0, 1):
            self.kill_host(host)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)

    # ------------------------------------------------------------------ processes
    def command(self, host: int, argv: Sequence[str], spare: bool = False) -> list[str]:
        """``argv`` as run on ``host`` (its network namespace, and its own hostname in the per-host set-up; ``spare``:
        the replacement machine's)."""
        prefix = ["ip", "netns", "exec", self.names[host]]
        if self.hostnames == "per_host":
            name = self.hostname(host, spare)
            prefix += ["unshare", "--uts", "sh", "-c", f'hostname {name} && exec "$@"', "sh"]
        elif spare:
            raise ValueError("a spare machine needs hostnames='per_host'")
        return [*prefix, *argv]

    def start(self, host: int, argv: Sequence[str], log: Path, env: dict[str, str], cwd: Path,
              spare: bool = False) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in a new session, its output in ``log``."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(self.command(host, argv, spare), env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def pids(self, host: int) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", self.names[host]], check=False, capture_output=True, text=True)
        return [int(p) for p in listed.stdout.split()]

    def kill_host(self, host: int, timeout: float = 10.0) -> None:
        """SIGKILL every process on ``host``, launcher included, as when a machine dies."""
        deadline = time.monotonic() + timeout
        while (pids := self.pids(host)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def set_link(self, host: int, up: bool) -> None:
        """Bring ``host``'s end of the pair down (a switch dropping it) or back up."""
        _ip("-n", self.names[host], "link", "set", self.links[host], "up" if up else "down")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
