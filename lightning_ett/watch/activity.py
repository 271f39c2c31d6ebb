"""Is a silent rank working? What the operating system says: CPU time and I/O of its process tree.

A rank can be silent in its ledger for a long time and still be doing legitimate work that no phase
announces: rank-zero-only evaluation or sample logging after a step, a slow epoch start in its
DataLoader workers, a recompile, a long checkpoint write. Its CPU time (every thread, its
DataLoader workers and other children included) or its I/O grows; a rank that waits for a peer in
a gloo collective, or sleeps in a deadlocked loader, uses next to none.

Thresholds: a rank's tree is *busy* over a sample window when it used at least :data:`BUSY_CPU`
of a core or moved at least :data:`BUSY_IO_BYTES` per second through system calls. Idle ranks use
far less (a waiting gloo rank measured here: under 1 % of a core, a few bytes per second from
its heartbeat threads); any real work uses far more.

On a GPU host, a rank waiting for a NCCL collective spins in CUDA's host synchronization at 100 %
of a core: CPU time there says nothing. The hang watch therefore counts a CUDA rank's CPU time only
while the flight recorder shows no collective of it pending (:mod:`lightning_ett.watch.flight_recorder`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from lightning_ett.durable.procfs import TreeSample, sample_tree

#: A rank's tree is busy when it used at least this share of one core over a sample window...
BUSY_CPU = 0.10
#: ...or moved at least this many bytes per second through read/write system calls.
BUSY_IO_BYTES = 256 * 1024
#: Seconds between two samples of a rank.
SAMPLE_S = 1.0


@dataclass(frozen=True)
class Activity:
    """What one rank's tree did between two samples."""

    cpu: float  # cores used on average
    io_per_s: float
    state: str  # the rank's own process state at the later sample (T: stopped)

    @property
    def busy_cpu(self) -> bool:
        return self.cpu >= BUSY_CPU

    @property
    def busy_io(self) -> bool:
        return self.io_per_s >= BUSY_IO_BYTES


def activity_between(before: TreeSample, after: TreeSample, seconds: float) -> Activity:
    """The activity between two samples of one tree; a counter that dropped (a child exited) counts as none."""
    seconds = max(seconds, 1e-3)
    return Activity(max(after.cpu_s - before.cpu_s, 0.0) / seconds, max(after.io_bytes - before.io_bytes, 0) / seconds,
                    after.state)


class ActivityMeter:
    """Samples each rank's process tree every :data:`SAMPLE_S` and remembers when it was last busy."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, TreeSample]] = {}
        self.latest: dict[int, Activity] = {}
        #: When each rank was last busy on CPU, and last busy on I/O (wall-clock seconds).
        self.busy_cpu_at: dict[int, float] = {}
        self.busy_io_at: dict[int, float] = {}

    def sample(self, pids: dict[int, int], now: float | None = None, force: bool = False) -> None:
        """Sample ``rank -> pid`` (each at most every :data:`SAMPLE_S`, unless ``force``)."""
        now = time.time() if now is None else now
        for rank, pid in pids.items():
            last = self._last.get(rank)
            if last is not None and not force and now - last[0] < SAMPLE_S:
                continue
            sample = sample_tree(pid)
            if sample is None:
                continue
            if last is not None:
                activity = activity_between(last[1], sample, now - last[0])
                self.latest[rank] = activity
                if activity.busy_cpu:
                    self.busy_cpu_at[rank] = now
                if activity.busy_io:
                    self.busy_io_at[rank] = now
            self._last[rank] = (now, sample)
