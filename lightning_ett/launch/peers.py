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
* every other node notes when the store last answered: node 0 is unreachable after
  :data:`SILENT_S` without an answer.

What the launcher does about it (stop a group blocked on the lost node, keep its agent alive
while the store is unreachable) is in :mod:`lightning_ett.launch.launcher`. Its own TCPStore
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
#: A node whose heartbeat has not moved for this long is lost (node 0 says so within SILENT_S + HEARTBEAT_S + 1 s).
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

    def line(self) -> str:
        if self.kind == "node_lost":
            return (f"node {self.node_rank} ({self.address}) stopped responding (no heartbeat for "
                    f"{self.time - self.since:.0f} s); waiting for it, or a launcher replacing it, to rejoin")
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
    since: float  # the lost node's last heartbeat (or the store's last answer): the ``node_lost`` phase starts there
    stopped: float
    ranks: list[int]
    via_store: bool = False  # seen from a node other than 0: the store on node 0 stopped answering

    @property
    def reason(self) -> str:
        how = "the rendezvous store there stopped answering" if self.via_store else "no heartbeat"
        return (f"node {self.node} ({self.address}) stopped responding ({how} for {self.stopped - self.since:.0f} s) "
                "while this node's ranks waited on it")

    def failure_records(self) -> list[dict[str, Any]]:
        lost = {"node": self.node, "address": self.address, "since": self.since, "stopped": self.stopped}
        return [{"kind": "failure", "attempt": self.attempt, "time": self.stopped, "rank": rank,
                 "exitcode": -int(signal.SIGKILL), "root_cause": i == 0, "node_lost": lost,
                 "reason": self.reason if i == 0 else f"stopped by the launcher: node {self.node} stopped responding"}
                for i, rank in enumerate(self.ranks)]


@dataclass
class _Peer:
    count: int = 0
    address: str = "?"
    changed: float = 0.0  # time.time() of the last change seen
    lost: bool = False


class PeerWatch:
    """The heartbeat thread of one launcher (see the module docstring).

    Args:
        host, port: the rendezvous store (node 0's ``--main-address`` and ``--main-port``).
        job_id: keys are per job, so a relaunch into the same store is not confused with an earlier one.
        node_rank, num_nodes, address: this node, and the address the report names it by.
        on_event: called from the heartbeat thread with each :class:`PeerEvent` (node 0 only).
    """

    def __init__(self, host: str, port: int, job_id: str, node_rank: int, num_nodes: int, address: str,
                 on_event: Callable[[PeerEvent], None] | None = None, silent_s: float = SILENT_S) -> None:
        self.host, self.port = host, port
        self.prefix = f"{_PREFIX}/{job_id}"
        self.node_rank, self.num_nodes, self.address = node_rank, num_nodes, address
        self.on_event = on_event
        self.silent_s = silent_s
        self.peers = {n: _Peer() for n in range(num_nodes) if n != node_rank}
        self.store_answered: float | None = None  # time.time() of the store's last answer
        self._stop = threading.Event()
        self._store: Any = None
        self._thread = threading.Thread(target=self._run, name="ett-peers", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def close(self, finished: bool) -> None:
        """Stop heartbeating; ``finished``: tell node 0 this node ended on purpose (not a loss)."""
        self._stop.set()
        self._thread.join(STORE_TIMEOUT_S + 1)
        if finished:
            _within(STORE_TIMEOUT_S, lambda: (self._store or self._connect()).set(f"{self.prefix}/done/{self.node_rank}", "1"))

    # ------------------------------------------------------------------ what the launcher asks
    def lost_nodes(self) -> dict[int, str]:
        """Node 0: nodes lost now (``node -> address``); other nodes: ``{0: address}`` while the store does not answer."""
        if self.node_rank == 0:
            return {n: p.address for n, p in self.peers.items() if p.lost}
        if self.store_answered is not None and time.time() - self.store_answered >= self.silent_s:
            return {0: self.host}
        return {}

    def silent_since(self, node: int) -> float | None:
        """When ``node`` was last heard (node 0's view of a peer; another node's view of node 0: the store)."""
        if self.node_rank == 0:
            return self.peers[node].changed if node in self.peers else None
        return self.store_answered

    # ------------------------------------------------------------------ the thread
    def _connect(self) -> Any:
        from torch.distributed import TCPStore

        # A plain connection first: TCPStore's own retries print a C++ warning each while the network is down.
        socket.create_connection((self.host, self.port), timeout=STORE_TIMEOUT_S).close()
        return TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S),
                        wait_for_workers=False)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not _within(STORE_TIMEOUT_S, self._beat):
                self._store = None  # no store (not up yet, node 0 gone, the network down): a new client next time
            self._stop.wait(HEARTBEAT_S)

    def _beat(self) -> None:
        if self._store is None:
            self._store = self._connect()
            self._store.set(f"{self.prefix}/address/{self.node_rank}", self.address)
        self._store.add(f"{self.prefix}/beat/{self.node_rank}", 1)
        self.store_answered = time.time()
        if self.node_rank == 0:
            self._look(self._store)

    def _look(self, store: Any) -> None:
        now = time.time()
        for node, peer in self.peers.items():
            count = int(store.add(f"{self.prefix}/beat/{node}", 0))
            if count != peer.count:
                if peer.count == 0 or peer.address == "?":
                    with contextlib.suppress(Exception):
                        peer.address = store.get(f"{self.prefix}/address/{node}").decode()
                back = peer.lost
                peer.count, peer.changed, peer.lost = count, now, False
                if back:
                    self._said(PeerEvent("node_back", node, peer.address, now, now))
            elif peer.count and not peer.lost and now - peer.changed >= self.silent_s \
                    and not store.check([f"{self.prefix}/done/{node}"]):
                peer.lost = True
                self._said(PeerEvent("node_lost", node, peer.address, peer.changed, now))

    def _said(self, event: PeerEvent) -> None:
        if self.on_event is not None:
            with contextlib.suppress(Exception):
                self.on_event(event)


def _within(seconds: float, op: Callable[[], Any]) -> bool:
    """Run ``op`` in a thread of its own; False if it raised or had not returned after ``seconds``.

    A TCPStore client's ``add`` has no deadline of its own: across a partition it blocks until the link is
    back, and on the connection it used then, for good. A blocked call is left behind with its client (a
    daemon thread, at most one per outage); the caller starts a new client.
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
    return bool(done and done[0])
