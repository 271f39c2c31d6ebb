"""Stacks of a hung rank: ask for them, read them back, and tell whether it waits in a collective.

Each worker registers :mod:`faulthandler` on :data:`DUMP_SIGNAL` (:func:`register_dump_signal`):
the dump is written by a C signal handler, so it arrives even from a rank blocked inside a C call
(a gloo wait, a read on a dead mount), every thread included, into a file of the rank's own in the
run directory (:func:`stack_dump_path`). ``py-spy`` adds native frames where it is installed and allowed to attach.
"""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

#: The signal a worker dumps its stacks on (SIGUSR1 is taken by Lightning's SLURM requeue).
DUMP_SIGNAL = signal.SIGUSR2
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)(?: \[[^\]]*\])? \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$')
#: Frames of code that waits for other ranks: the Python side of every collective we know of, and the
#: process-group helpers DDP calls at its start (``torch/distributed/utils.py``: parameter checks and
#: broadcasts). Not DDP's own wrapper (``torch/nn/parallel/distributed.py``): a model's forward runs inside
#: it, so a rank stuck in its own ``training_step`` would count as waiting for its peers.
_COLLECTIVE = re.compile(r"torch/distributed/(distributed_c10d|_functional_collectives|algorithms/|utils\.py)"
                         r"|torchrec/distributed/(comm_ops|dist_data|types)\.py")
#: Backward: DDP's gradient all-reduce and TorchRec's all-to-all backward run inside autograd's engine, in C++,
#: so a rank waiting for them shows only this frame. Not proof of waiting (backward also computes); with no CPU
#: time used, it is.
_BACKWARD = re.compile(r"torch/autograd/(graph|__init__)\.py")
_STDLIB = sysconfig.get_paths()["stdlib"]


_registered: tuple[int, object] | None = None  # (pid, the file dumps go to): kept open for faulthandler


def stack_dump_path(run_dir: str | os.PathLike, attempt: int, rank: int) -> Path:
    """Where a rank under ``lightning run`` writes its stack dumps: a file of its own, not its stderr, which the
    launcher echoes to the console (a hang's two dumps of every thread were hundreds of lines there)."""
    return Path(run_dir) / "stacks" / f"attempt-{attempt:04d}" / f"rank-{rank:05d}.txt"


def register_dump_signal(path: str | os.PathLike | None = None) -> None:
    """Make this process dump every thread's Python stack on :data:`DUMP_SIGNAL`, into ``path`` (stderr if ``None``
    or not writable). Once per process: a later call keeps the first file."""
    global _registered
    if _registered is not None and _registered[0] == os.getpid():
        return
    out: object = sys.stderr
    if path is not None:
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            out = open(path, "a")  # noqa: SIM115 - faulthandler writes to it until the process ends
        except OSError:
            out = sys.stderr
    faulthandler.register(DUMP_SIGNAL, file=out, all_threads=True, chain=False)  # type: ignore[arg-type]
    _registered = (os.getpid(), out)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{Path(self.file).name}:{self.line} in {self.function}"


@dataclass(frozen=True)
class StackDump:
    """One faulthandler dump: the main thread's frames (innermost first) and the thread count."""

    main: tuple[Frame, ...]
    threads: int

    @property
    def in_collective(self) -> bool:
        return any(_COLLECTIVE.search(f.file.replace(os.sep, "/")) for f in self.main)

    @property
    def in_backward(self) -> bool:
        return any(_BACKWARD.search(f.file.replace(os.sep, "/")) for f in self.main)

    def top(self, n: int = 5) -> list[str]:
        return [str(f) for f in self.main[:n]]

    def culprit_frame(self) -> Frame | None:
        """The innermost frame outside the standard library: the code that stopped, not ``threading.wait``."""
        own = [f for f in self.main if not f.file.startswith(_STDLIB) or "site-packages" in f.file]
        return (own or list(self.main) or [None])[0]


def parse_dump(text: str) -> StackDump | None:
    """The faulthandler dump in ``text`` (a worker's stderr from just before the signal), or ``None``.

    The main thread is the one running Lightning (or the script's ``<module>``): faulthandler's
    "current thread" is whichever thread the kernel handed the signal to.
    """
    threads: list[tuple[bool, list[Frame]]] = []
    for line in text.splitlines():
        if m := _THREAD.match(line):
            threads.append((m.group(1) == "Current thread", []))
        elif threads and (m := _FRAME.match(line)):
            threads[-1][1].append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    if not threads:
        return None
    main = next((frames for _, frames in threads if any("lightning/pytorch/" in f.file for f in frames)), None)
    main = main or next((frames for _, frames in threads if any(f.function == "<module>" for f in frames)), None)
    main = main or next((frames for current, frames in threads if current), threads[0][1])
    return StackDump(tuple(main), len(threads))


def request_dumps(pids: dict[int, int], log_paths: dict[int, str | None], timeout_s: float = 3.0) -> dict[int, StackDump | None]:
    """Signal each rank (``rank -> pid``) to dump, then read each dump back from its log (``rank -> path``)."""
    offsets = {rank: _size(log_paths.get(rank)) for rank in pids}
    for pid in pids.values():
        try:
            os.kill(pid, DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    dumps: dict[int, StackDump | None] = dict.fromkeys(pids)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for rank in pids:
            if dumps[rank] is None:
                text = _read_from(log_paths.get(rank), offsets[rank])
                dumps[rank] = parse_dump(text) if "(most recent call first)" in text else None
        if all(d is not None for d in dumps.values()):
            time.sleep(0.1)  # the signal handler writes thread by thread: let the last ones land
            return {rank: parse_dump(_read_from(log_paths.get(rank), offsets[rank])) for rank in pids}
        time.sleep(0.05)
    return dumps


def py_spy_dumps(pids: dict[int, int], out_paths: dict[int, Path], timeout_s: float = 10.0) -> dict[int, Path]:
    """Native and Python frames of every rank and its children from ``py-spy dump --native --subprocesses``, one file per
    rank, when py-spy is installed.

    py-spy needs ptrace permission over the workers (containers often withhold it): its error is
    written into the file instead, and the watch goes on without it.
    """
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if exe is None:
        return {}
    running = {}
    for rank, pid in pids.items():
        path = out_paths[rank]
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "wb")  # noqa: SIM115 - closed below, after the process ends
        # --subprocesses: a rank waiting on its DataLoader shows where its loader workers are stuck too.
        running[rank] = (subprocess.Popen([exe, "dump", "--native", "--subprocesses", "--pid", str(pid)], stdout=f,
                                          stderr=subprocess.STDOUT), f, path)
    deadline = time.monotonic() + timeout_s
    written = {}
    for rank, (proc, f, path) in running.items():
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        f.close()
        written[rank] = path
    return written


def _size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def _read_from(path: str | None, offset: int) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""
