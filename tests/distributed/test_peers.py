"""PeerWatch against a real TCPStore on this machine: who is lost, and which launcher's lock node 0 may declare gone."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

from torch.distributed import TCPStore

from lightning_ett.launch.peers import HEARTBEAT_S, PeerEvent, PeerWatch

#: Shorter than the product's 15 s, to keep the tests short, but 3 heartbeats: a beat late by a second on a loaded
#: host is no lost node (with 3 s, one 1 s delay was).
SILENT = 6.0


def _store() -> tuple[TCPStore, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False), port


def _wait(events: list[PeerEvent], kind: str, timeout: float) -> PeerEvent:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in events:
            if event.kind == kind:
                return event
        time.sleep(0.1)
    raise AssertionError(f"no {kind} event within {timeout} s: {events}")


def test_a_silent_node_is_lost_naming_its_launchers_lock_and_its_replacement_is_back_naming_its_own():
    store, port = _store()
    events: list[PeerEvent] = []
    node0 = PeerWatch("127.0.0.1", port, "job", 0, 2, "10.0.0.1", on_event=events.append, silent_s=SILENT,
                      owner_token="lock-0").start()
    node1 = PeerWatch("127.0.0.1", port, "job", 1, 2, "10.0.0.2", silent_s=SILENT, owner_token="lock-1").start()
    try:
        time.sleep(SILENT + HEARTBEAT_S + 0.5)
        assert events == []  # heartbeating for longer than the silence that makes a node lost: no false alarm
        node1.close(finished=False)  # its host died (it never said it finished)
        lost = _wait(events, "node_lost", timeout=SILENT + 2 * HEARTBEAT_S + 2)
        assert (lost.node_rank, lost.address, lost.owner_token) == (1, "10.0.0.2", "lock-1")
        replacement = PeerWatch("127.0.0.1", port, "job", 1, 2, "10.0.0.9", silent_s=SILENT, owner_token="lock-1b").start()
        back = _wait(events, "node_back", timeout=2 * HEARTBEAT_S + 2)
        assert (back.address, back.owner_token) == ("10.0.0.9", "lock-1b")  # the replacement, on another host
        replacement.close(finished=True)
    finally:
        node0.close(finished=True)
        del store


def test_a_node_that_finished_is_not_lost():
    store, port = _store()
    events: list[PeerEvent] = []
    node0 = PeerWatch("127.0.0.1", port, "job", 0, 2, "a", on_event=events.append, silent_s=SILENT).start()
    node1 = PeerWatch("127.0.0.1", port, "job", 1, 2, "b", silent_s=SILENT).start()
    try:
        time.sleep(HEARTBEAT_S + 0.5)
        node1.close(finished=True)
        time.sleep(SILENT + 2 * HEARTBEAT_S + 1)
        assert events == []
    finally:
        node0.close(finished=True)
        del store
