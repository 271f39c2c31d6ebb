"""Node liveness for a multi-node ``lightning run``: every launcher heartbeats, node 0 notices a silent node.

torch elastic finds a dead node only inside its rendezvous, and says nothing a user can read: a
node that dies whole leaves the others' workers failing with "Connection reset by peer" and their
agents waiting, silently, for a replacement; a partition leaves them blocked in a collective until
the process group's 30-minute timeout. Here each launcher adds to a counter of its own in the
rendezvous store (the TCPStore node 0's agent hosts at ``--main-address:--main-port``) every
:data:`HEARTBEAT_S`:

* node 0 reads every node's counter; one that has not moved for :data:`SILENT_S` is *lost*:
  ``node 1 (10.0.0.2) stopped responding``, said once, on the console and in the launcher's
  ledger (``node_lost``), and ``node_back`` when it, or a launcher replacing it, counts again;
* when node 0 stops an attempt for a lost node, it says so in the store (:meth:`PeerWatch.announce_stop`)
  and every other node stops its ranks of that attempt as soon as it reads it.

Silence alone stops nothing: the hang watch decides whether this node's ranks are stalled (its learned
limits and evidence, :mod:`lightning_ett.launch.hang_response`), and a lost node only names the cause
and lets the watch act where it would otherwise wait for the other node's watch. Keeping the agent
alive while the store is unreachable is in :mod:`lightning_ett.launch.launcher`. Its own TCPStore
client, not the agent's: a heartbeat must never wait behind the rendezvous, nor it behind one.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

#: Each launcher's heartbeat period.
HEARTBEAT_S = 2.0
#: A node whose heartbeat has not moved for this long is lost (node 0 says so within about SILENT_S + 2 * HEARTBEAT_S
#: of its last beat: node 0 sees a beat, and then the silence, at its own next look).
SILENT_S = 15.0
#: A store operation that takes longer than this failed (the heartbeat then reconnects).
STORE_TIMEOUT_S = 5.0
_PREFIX = "lightning_ett/peers"


@dataclass(frozen=True)
class PeerEvent:
    """A node lost or back, as node 0 saw it (times are node 0's clock)."""

    kind: str  # "node_lost" or "node_back"
    node_rank: int
    address: str
    since: float  # node_lost: the last heartbeat seen; node_back: the first one again
    time: float
    owner_token: str | None = None  # the token of that node's launcher's run-directory lock, as it published it

    def line(self) -> str:
        if self.kind == "node_lost":
            return (f"node {self.node_rank} ({self.address}) stopped responding (no heartbeat for "
                    f"{self.time - self.since:.0f} s)")
        return f"node {self.node_rank} ({self.address}) is responding again"

    def record(self, attempt: int) -> dict[str, Any]:
        return {"kind": self.kind, "node_rank": self.node_rank, "address": self.address, "since": self.since,
                "time": self.time, "attempt": attempt}


@dataclass(frozen=True)
class NodeLostVerdict:
    """This node's ranks were stopped because ``node`` was lost while they waited on it: the attempt's failure."""

    attempt: int
    node: int
    address: str
    since: float  # the lost node's last heartbeat: the ``node_lost`` phase starts there
    stopped: float
    ranks: list[int]
    told: str | None = None  # on another node than 0: node 0's reason, read from the store
    stopping: float | None = None  # when the stop began (SIGTERM); ``stopped`` is when the ranks were gone

    @property
    def reason(self) -> str:
        if self.told is not None:
            return f"stopped by node 0: {self.told}"
        return (f"node {self.node} ({self.address}) stopped responding (no heartbeat for {self.stopped - self.since:.0f} s) "
                "while this node's ranks waited on it")

    def failure_records(self) -> list[dict[str, Any]]:
        lost = {"node": self.node, "address": self.address, "since": self.since, "stopped": self.stopped,
                **({"stopping": self.stopping} if self.stopping is not None else {})}
        return [{"kind": "failure", "attempt": self.attempt, "time": self.stopped, "rank": rank,
                 "exitcode": -int(signal.SIGKILL), "root_cause": i == 0, "node_lost": lost,
                 "reason": self.reason if i == 0 else f"stopped by the launcher: node {self.node} stopped responding"}
                for i, rank in enumerate(self.ranks)]


@dataclass
class _Peer:
    count: int = 0
    address: str = "?"
    owner_token: str | None = None
    changed: float = 0.0  # time.time() of the last change seen
    lost: bool = False


class PeerWatch:
    """The heartbeat thread of one launcher (see the module docstring).

    Args:
        host, port: the rendezvous store (node 0's ``--main-address`` and ``--main-port``).
        job_id: keys are per job, so a relaunch into the same store is not confused with an earlier one.
        node_rank, num_nodes, address: this node, and the address the report names it by.
        owner_token: the token of this launcher's lock on its part of the run directory, which node 0 declares gone
            when this node stops responding (:func:`lightning_ett.durable.ownership.declare_gone`).
        on_event: node 0: called from the heartbeat thread with each :class:`PeerEvent`.
        on_stop: other nodes: called from the heartbeat thread with ``(attempt, reason)`` once node 0 said it
            stopped that attempt for a lost node (:meth:`announce_stop`).
    """

    def __init__(self, host: str, port: int, job_id: str, node_rank: int, num_nodes: int, address: str,
                 on_event: Callable[[PeerEvent], None] | None = None,
                 on_stop: Callable[[int, str], None] | None = None, silent_s: float = SILENT_S,
                 owner_token: str | None = None) -> None:
        self.host, self.port = host, port
        self.prefix = f"{_PREFIX}/{job_id}"
        self.node_rank, self.num_nodes, self.address = node_rank, num_nodes, address
        self.owner_token = owner_token
        self.on_event, self.on_stop = on_event, on_stop
        self.silent_s = silent_s
        self.attempt = -1  # the running attempt (the launcher sets it): a stop is for one attempt only
        self.peers = {n: _Peer() for n in range(num_nodes) if n != node_rank}
        self._stops_seen: set[int] = set()
        self._stop = threading.Event()
        self._closed = False
        self._store: Any = None
        self._fresh = True  # a new client: (re)state this node's address and clear an earlier launcher's "done"
        self._thread = threading.Thread(target=self._run, name="ett-peers", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def close(self, finished: bool) -> None:
        """Stop heartbeating; ``finished``: tell node 0 this node ended on purpose (not a loss). Once: later calls do
        nothing (node 0's store may be gone by then)."""
        if self._closed:
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(STORE_TIMEOUT_S + 1)
        if finished:
            _within(STORE_TIMEOUT_S, lambda: (self._store or self._connect()).set(f"{self.prefix}/done/{self.node_rank}", "1"))
        self._closed = True  # (last: a close interrupted by a signal is done again by the next one)

    # ------------------------------------------------------------------ what the launcher asks
    def lost(self) -> tuple[int, str, float] | None:
        """Node 0: a node lost now, as ``(node, address, its last heartbeat)``; None when none is (or not node 0)."""
        lost = [(n, p.address, p.changed) for n, p in sorted(self.peers.items()) if p.lost]
        return lost[0] if lost and self.node_rank == 0 else None

    def announce_stop(self, attempt: int, reason: str) -> None:
        """Node 0 stopped ``attempt`` for a lost node: the other nodes stop theirs too (their ranks may wait, past the
        outage, on peers that are gone: a partition swallows the connection resets)."""
        _within(STORE_TIMEOUT_S, lambda: (self._store or self._connect()).set(f"{self.prefix}/stopped/{attempt}", reason))

    # ------------------------------------------------------------------ the thread
    def _connect(self) -> Any:
        from torch.distributed import TCPStore

        # A plain connection first: TCPStore's own retries print a C++ warning each while the network is down.
        socket.create_connection((self.host, self.port), timeout=STORE_TIMEOUT_S).close()
        return TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S),
                        wait_for_workers=False)

    def _run(self) -> None:
        import torch.distributed  # noqa: F401 - imported here once, not inside a timed store operation

        op: threading.Thread | None = None
        while not self._stop.is_set():
            if op is None or not op.is_alive():  # (one store operation at a time: never two looks racing)
                op = _within(STORE_TIMEOUT_S, self._beat, on_failure=self._drop)
            self._stop.wait(HEARTBEAT_S)

    def _drop(self) -> None:
        self._store, self._fresh = None, True  # no store (not up yet, node 0 gone, the network down): a new client

    def _beat(self) -> None:
        if self._store is None:
            self._store = self._connect()
        if self._fresh:
            self._store.set(f"{self.prefix}/address/{self.node_rank}", self.address)
            self._store.set(f"{self.prefix}/owner/{self.node_rank}", self.owner_token or "")
            self._store.delete_key(f"{self.prefix}/done/{self.node_rank}")  # a replacement of a node that ended
            self._fresh = False
        self._store.add(f"{self.prefix}/beat/{self.node_rank}", 1)
        if self.node_rank == 0:
            self._look(self._store)
        elif self.attempt >= 0 and self.attempt not in self._stops_seen \
                and self._store.check([key := f"{self.prefix}/stopped/{self.attempt}"]):
            self._stops_seen.add(self.attempt)
            if self.on_stop is not None:
                self.on_stop(self.attempt, self._store.get(key).decode())

    def _look(self, store: Any) -> None:
        now = time.time()
        for node, peer in self.peers.items():
            count = int(store.add(f"{self.prefix}/beat/{node}", 0))
            if count != peer.count:
                if peer.count == 0 or peer.lost:  # (a replacement may run on another host)
                    with contextlib.suppress(Exception):
                        peer.address = store.get(f"{self.prefix}/address/{node}").decode()
                        peer.owner_token = store.get(f"{self.prefix}/owner/{node}").decode() or None
                back = peer.lost
                peer.count, peer.changed, peer.lost = count, now, False
                if back:
                    self._said(PeerEvent("node_back", node, peer.address, now, now, peer.owner_token))
            elif peer.count and not peer.lost and now - peer.changed >= self.silent_s \
                    and not store.check([f"{self.prefix}/done/{node}"]):
                peer.lost = True
                with contextlib.suppress(Exception):  # the launcher that went silent (one may have replaced another)
                    peer.owner_token = store.get(f"{self.prefix}/owner/{node}").decode() or None
                self._said(PeerEvent("node_lost", node, peer.address, peer.changed, now, peer.owner_token))

    def _said(self, event: PeerEvent) -> None:
        if self.on_event is not None:
            with contextlib.suppress(Exception):
                self.on_event(event)


def _within(seconds: float, op: Callable[[], Any], on_failure: Callable[[], None] | None = None) -> threading.Thread:
    """Run ``op`` in a thread of its own and wait up to ``seconds``; ``on_failure`` if it raised or had not returned.

    A TCPStore client's ``add`` has no deadline of its own: across a partition it blocks until the link is
    back, and on the connection it used then, for good. A blocked call is left behind with its client (a
    daemon thread; the caller starts no other while it lives), and the caller makes a new client.
    """
    done: list[bool] = []

    def run() -> None:
        try:
            op()
            done.append(True)
        except Exception:  # noqa: BLE001 - the caller only needs to know it did not answer
            done.append(False)

    thread = threading.Thread(target=run, name="ett-peers-op", daemon=True)
    thread.start()
    thread.join(seconds)
    if not (done and done[0]) and on_failure is not None:
        on_failure()
    return thread
