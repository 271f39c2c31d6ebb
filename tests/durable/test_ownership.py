"""One live owner per directory: acquire, refuse naming the owner, take over stale owners, release only ours."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO

from lightning_ett.durable import ownership
from lightning_ett.durable.ownership import (
    DirectoryInUseError,
    Owner,
    OwnerLock,
    StaleOwnerWarning,
    declare_gone,
    read_owner,
    withdraw_gone,
)
from lightning_ett.durable.procfs import process_alive, process_start_ticks

LOCK = ".ett-owner"


def lock(tmp_path: Path, job_id: str = "job-b", attempt: int | None = None, **kwargs) -> OwnerLock:
    return OwnerLock(tmp_path, LOCK, job_id, attempt, what=f"dir {str(tmp_path)!r}", fix="Pass another dir.", **kwargs)


def plant(tmp_path: Path, age_s: float = 0.0, **fields) -> Owner:
    """A lock file as another owner would have left it (by default: this host, a live process, now)."""
    me = Owner.me("job-a", 0)
    fields = {"pid": os.getppid(), "process_start": process_start_ticks(os.getppid()), **fields}
    owner = replace(me, **fields)
    path = tmp_path / LOCK
    path.write_bytes(owner.to_bytes())
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return owner


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_acquire_writes_who_owns_the_directory_and_release_removes_it(tmp_path):
    owner = lock(tmp_path, attempt=3)
    assert owner.acquire() is None
    held = read_owner(tmp_path / LOCK)
    assert held is not None and held == owner.owner
    raw = json.loads((tmp_path / LOCK).read_text())
    assert raw["job_id"] == "job-b" and raw["pid"] == os.getpid() and raw["host"] == socket.gethostname()
    assert raw["attempt"] == 3 and raw["process_start"] == process_start_ticks(os.getpid()) and raw["acquired"] > 0
    owner.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temp file left either
    owner.release()  # twice is harmless


def test_a_live_owner_refuses_a_second_one_naming_its_job_host_and_pid(tmp_path):
    first = lock(tmp_path, job_id="job-a")
    first.acquire()
    try:
        with pytest.raises(DirectoryInUseError) as refused:
            lock(tmp_path).acquire()  # another object of this process: it does not hold the lock
        message = str(refused.value)
        assert f"dir {str(tmp_path)!r} is in use by job 'job-a'" in message
        assert f"pid {os.getpid()} on host {socket.gethostname()!r}" in message
        assert "Pass another dir." in message and str(tmp_path / LOCK) in message
        planted_elsewhere = tmp_path / "other"
        planted_elsewhere.mkdir()
        plant(planted_elsewhere)  # the parent process: alive, on this host
        with pytest.raises(DirectoryInUseError, match=f"pid {os.getppid()} on host"):
            lock(planted_elsewhere).acquire()
    finally:
        first.release()
    assert read_owner(tmp_path / LOCK) is None


def test_an_owner_whose_process_is_gone_is_taken_over_with_a_warning(tmp_path):
    gone = plant(tmp_path, pid=dead_pid(), process_start=None)
    owner = lock(tmp_path)
    with pytest.warns(StaleOwnerWarning, match=rf"taking over from job 'job-a' \(pid {gone.pid} .*process {gone.pid} is gone"):
        assert owner.acquire() == gone
    assert read_owner(tmp_path / LOCK) == owner.owner
    owner.release()


def test_a_reused_pid_is_not_the_owner(tmp_path):
    # The pid lives, but it is a newer process than the one that took the lock.
    plant(tmp_path, process_start=process_start_ticks(os.getppid()) - 1)
    owner = lock(tmp_path)
    with pytest.warns(StaleOwnerWarning, match="is gone"):
        owner.acquire()
    owner.release()


def test_a_zombie_is_dead():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 10
    while process_alive(proc.pid) and time.time() < deadline:  # exited, not reaped yet
        time.sleep(0.02)
    assert not process_alive(proc.pid)
    proc.wait()
    assert process_alive(os.getpid(), process_start_ticks(os.getpid()))


def test_an_owner_on_another_host_lives_while_its_heartbeat_is_fresh(tmp_path):
    plant(tmp_path, host="node-7", pid=4242, age_s=5)
    with pytest.raises(DirectoryInUseError, match=r"pid 4242 on host 'node-7'.*last heartbeat was 5 s ago"):
        lock(tmp_path, stale_after_s=60).acquire()
    os.utime(tmp_path / LOCK, (time.time() - 90, time.time() - 90))
    owner = lock(tmp_path, stale_after_s=60)
    with pytest.warns(StaleOwnerWarning, match="no heartbeat for 90 s"):
        owner.acquire()
    owner.release()


def test_an_owner_on_another_host_that_a_peer_declared_gone_is_taken_over_after_three_heartbeats(tmp_path):
    # Node 1's host died; node 0 heard its launcher stop and said so. A replacement the scheduler starts on another
    # host must not wait out the 60 s staleness: 30 s of silence (three missed heartbeats) is enough once declared.
    dead = plant(tmp_path, host="node-7", pid=4242, age_s=35)
    with pytest.raises(DirectoryInUseError, match="node-7.*or 30 s after it once a peer declared it gone"):
        lock(tmp_path, stale_after_s=60).acquire()  # not declared: alive until 60 s
    assert declare_gone(tmp_path, LOCK, dead.token, "node 1 (10.0.0.2) stopped responding") == dead
    owner = lock(tmp_path, stale_after_s=60)
    with pytest.warns(StaleOwnerWarning, match=r"pid 4242 on host 'node-7'.*a peer declared it gone: node 1 \(10"):
        assert owner.acquire() == dead
    assert not (tmp_path / f"{LOCK}.gone").exists()  # it named the owner taken over, and is spent
    owner.release()


def test_a_declared_owner_that_keeps_its_heartbeat_is_never_taken_over(tmp_path):
    # A partition between the nodes, not between node 1 and the file server: node 0 declared node 1 gone, but node
    # 1's launcher lives and refreshes its lock. A patient acquirer sees the refresh and is refused, naming why.
    alive = plant(tmp_path, host="node-7", pid=4242, age_s=25)
    declare_gone(tmp_path, LOCK, alive.token, "node 1 stopped responding")
    refresher = threading.Timer(2.0, lambda: os.utime(tmp_path / LOCK))  # its next heartbeat
    refresher.start()
    started = time.monotonic()
    with pytest.raises(DirectoryInUseError, match="node-7.*alive: it refreshed its lock while this process waited"):
        lock(tmp_path, heartbeat_s=10, stale_after_s=60).acquire(patience_s=40)
    refresher.join()
    assert 2.0 <= time.monotonic() - started < 5.0  # refused once it saw the refresh, not after its patience
    withdraw_gone(tmp_path, LOCK)  # it answered node 0 again (the partition healed)
    os.utime(tmp_path / LOCK, (time.time() - 35, time.time() - 35))
    with pytest.raises(DirectoryInUseError, match="node-7"):
        lock(tmp_path, stale_after_s=60).acquire()  # 35 s silent but no longer declared: alive until 60 s


def test_a_patient_acquirer_takes_over_once_the_owner_is_declared_gone_meanwhile(tmp_path):
    # A replacement started right after node 1's death, before node 0 noticed: it waits for the declaration.
    dead = plant(tmp_path, host="node-7", pid=4242, age_s=27)
    declarer = threading.Timer(1.0, lambda: declare_gone(tmp_path, LOCK, dead.token, "node 1 stopped responding"))
    declarer.start()
    said: list[str] = []
    owner = lock(tmp_path, stale_after_s=60)
    started = time.monotonic()
    with pytest.warns(StaleOwnerWarning, match="a peer declared it gone"):
        assert owner.acquire(patience_s=40, on_wait=said.append) == dead
    declarer.join()
    assert 2.0 <= time.monotonic() - started < 6.0  # once the lock was 30 s silent
    assert len(said) == 1 and "node-7" in said[0] and "waiting up to" in said[0]
    owner.release()


def test_a_patient_acquirer_waits_on_for_the_staleness_of_an_owner_that_never_refreshed(tmp_path):
    # No declaration came (node 0 is itself the lost node, or it could not write it): the lock goes stale at 60 s.
    plant(tmp_path, host="node-7", pid=4242, age_s=55)
    owner = lock(tmp_path, stale_after_s=60)
    started = time.monotonic()
    with pytest.warns(StaleOwnerWarning, match="no heartbeat for 6"):
        assert owner.acquire(patience_s=2) is not None
    assert 4.0 <= time.monotonic() - started < 9.0
    owner.release()


def test_a_patient_acquirer_is_refused_at_once_by_a_live_owner_on_this_host(tmp_path):
    plant(tmp_path, pid=os.getppid())
    started = time.monotonic()
    with pytest.raises(DirectoryInUseError):
        lock(tmp_path).acquire(patience_s=30)
    assert time.monotonic() - started < 1.0


def test_a_declaration_names_one_owner_and_never_another(tmp_path):
    dead = plant(tmp_path, host="node-7", pid=4242, age_s=35)
    replacement = plant(tmp_path, host="node-8", pid=4343, age_s=35)  # took the lock before node 0 noticed the loss
    assert declare_gone(tmp_path, LOCK, dead.token, "node 1 stopped responding") is None  # nothing to declare
    assert not (tmp_path / f"{LOCK}.gone").exists()
    declare_gone(tmp_path, LOCK, replacement.token, "node 1 stopped responding")
    plant(tmp_path, host="node-9", pid=4444, age_s=35)  # yet another owner since: the declaration is not about it
    with pytest.raises(DirectoryInUseError, match="node-9"):
        lock(tmp_path, stale_after_s=60).acquire()
    (tmp_path / LOCK).unlink()
    assert declare_gone(tmp_path, LOCK, replacement.token, "no lock") is None


def test_an_owner_declared_gone_that_releases_takes_the_declaration_back(tmp_path):
    owner = lock(tmp_path)
    owner.acquire()
    declare_gone(tmp_path, LOCK, owner.owner.token, "node 1 stopped responding")
    owner.release()
    assert not list(tmp_path.iterdir())  # neither its lock nor a declaration about it is left


def test_the_previous_attempt_of_the_same_job_is_taken_over_quietly(tmp_path, recwarn):
    plant(tmp_path, host="node-7", job_id="job-b", attempt=0)  # rank 0 of attempt 0 ran on another node
    with pytest.raises(DirectoryInUseError):
        lock(tmp_path, attempt=1).acquire()  # only where the caller says earlier attempts were stopped
    with pytest.raises(DirectoryInUseError):
        lock(tmp_path, attempt=0, earlier_attempts_are_stopped=True).acquire()  # the same attempt: another job
    owner = lock(tmp_path, attempt=1, earlier_attempts_are_stopped=True)
    assert owner.acquire() is not None
    assert not [w for w in recwarn if issubclass(w.category, StaleOwnerWarning)]
    owner.release()
    plant(tmp_path, job_id="job-b", attempt=0)  # alive on this host: not a stopped attempt, whatever it says
    with pytest.raises(DirectoryInUseError):
        lock(tmp_path, attempt=1, earlier_attempts_are_stopped=True).acquire()


def test_release_removes_only_its_own_lock(tmp_path):
    owner = lock(tmp_path)
    owner.acquire()
    newer = plant(tmp_path, host="node-7")  # someone judged us stale and took over
    owner.release()
    assert read_owner(tmp_path / LOCK) == newer


def test_the_heartbeat_refreshes_the_lock_and_says_when_it_was_lost(tmp_path):
    owner = lock(tmp_path, heartbeat_s=0.05, stale_after_s=1)
    owner.acquire()
    try:
        os.utime(tmp_path / LOCK, (time.time() - 30, time.time() - 30))
        deadline = time.time() + 5
        while time.time() - (tmp_path / LOCK).stat().st_mtime > 10 and time.time() < deadline:
            time.sleep(0.02)
        assert time.time() - (tmp_path / LOCK).stat().st_mtime < 10
        with warnings.catch_warnings(record=True) as caught:  # (the heartbeat thread warns)
            warnings.simplefilter("always")
            (tmp_path / LOCK).unlink()
            owner._thread.join(timeout=5)
        assert any("was removed or replaced" in str(w.message) for w in caught), caught
    finally:
        owner.release()


def test_an_unreadable_lock_is_taken_over_once_it_is_old(tmp_path):
    (tmp_path / LOCK).write_text("garbage")
    then = time.time() - 10
    os.utime(tmp_path / LOCK, (then, then))
    owner = lock(tmp_path)
    with pytest.warns(StaleOwnerWarning, match="unreadable"):
        owner.acquire()
    owner.release()


def test_without_hard_links_exclusive_creation_is_used(tmp_path, monkeypatch):
    def no_links(*_):
        raise OSError(ownership.errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(ownership.os, "link", no_links)
    first = lock(tmp_path)
    first.acquire()
    with pytest.raises(DirectoryInUseError):
        lock(tmp_path).acquire()
    first.release()
    assert list(tmp_path.iterdir()) == []


RACER = """
import sys, time
from lightning_ett.durable.ownership import DirectoryInUseError, OwnerLock
directory, start = sys.argv[1], float(sys.argv[2])
owner = OwnerLock(directory, ".ett-owner", "racer")
time.sleep(max(start - time.time(), 0))
try:
    owner.acquire()
    print("won", flush=True)
except DirectoryInUseError:
    print("refused", flush=True)
time.sleep(1)  # the winner stays alive until every racer has tried
"""


@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale owner"])
def test_of_acquirers_racing_for_one_directory_exactly_one_wins(tmp_path, stale):
    if stale:
        plant(tmp_path, pid=dead_pid(), process_start=None)
    start = time.time() + 0.7  # every racer has started by then
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), repr(start)], stdout=subprocess.PIPE,
                               text=True, env=env) for _ in range(6)]
    try:
        said = sorted(racer.communicate(timeout=30)[0].strip() for racer in racers)
    finally:
        for racer in racers:
            racer.kill()
    assert said == ["refused"] * 5 + ["won"], said


def race(owner: OwnerLock, start: threading.Barrier, said: list[str]) -> None:
    start.wait()
    try:
        owner.acquire()
        said.append("won")
    except DirectoryInUseError:
        said.append("refused")


def test_of_threads_racing_to_take_over_a_stale_lock_exactly_one_wins_every_round(tmp_path):
    """Many rounds in one process: the interleavings of a takeover that a handful of processes rarely hit."""
    rounds, racers = 40, 6
    gone = dead_pid()
    for round_ in range(rounds):
        directory = tmp_path / str(round_)
        directory.mkdir()
        plant(directory, pid=gone, process_start=None)
        start = threading.Barrier(racers)
        said: list[str] = []
        locks = [lock(directory, job_id=f"racer-{i}", on_takeover=lambda _: None) for i in range(racers)]
        threads = [threading.Thread(target=race, args=(owner, start, said)) for owner in locks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        winners = [owner.owner for owner in locks if owner.owner is not None]
        held = read_owner(directory / LOCK)
        for owner in locks:
            owner.release()
        assert sorted(said) == ["refused"] * (racers - 1) + ["won"], (round_, said)
        assert winners == [held]  # the lock on disk names the one winner
        assert sorted(p.name for p in directory.iterdir()) == []  # nothing set aside or claimed is left behind


def claim_of(tmp_path: Path) -> Path:
    """Where an acquirer claims the takeover of the lock now in ``tmp_path``."""
    return tmp_path / f"{LOCK}.takeover-{hashlib.sha256((tmp_path / LOCK).read_bytes()).hexdigest()[:16]}"


def test_a_claimant_that_died_mid_takeover_is_passed_and_its_claim_removed(tmp_path):
    plant(tmp_path, pid=dead_pid(), process_start=None)
    claim_of(tmp_path).write_bytes(replace(Owner.me("job-c", 0), pid=dead_pid(), process_start=None).to_bytes())
    with pytest.warns(StaleOwnerWarning, match="taking over from job 'job-a'"):
        taken_over = lock(tmp_path).acquire()
    assert taken_over is not None and taken_over.job_id == "job-a"
    assert read_owner(tmp_path / LOCK).job_id == "job-b"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK]


def test_an_acquirer_waits_for_a_live_claimant_and_then_judges_what_it_left(tmp_path):
    """A takeover in progress is waited for, not counted as a lost race; once its claim is gone the lock is judged anew."""
    plant(tmp_path, pid=dead_pid(), process_start=None)
    claim = claim_of(tmp_path)
    claimant = replace(Owner.me("job-c", 0), pid=os.getppid(), process_start=process_start_ticks(os.getppid()))
    claim.write_bytes(claimant.to_bytes())  # a live process on this host
    acquirer = lock(tmp_path, on_takeover=lambda _: None)
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(acquirer.acquire()))
    thread.start()
    time.sleep(1.0)  # 50 polls: more than _RETRIES tries
    assert thread.is_alive() and acquirer.owner is None
    claim.unlink()  # the claimant gave up (the lock is still the stale one)
    thread.join(timeout=10)
    assert not thread.is_alive() and result[0].job_id == "job-a"
    assert read_owner(tmp_path / LOCK) == acquirer.owner
    acquirer.release()
    assert list(tmp_path.iterdir()) == []


def test_an_owner_releasing_is_never_judged_abandoned_by_another_thread_of_its_process(tmp_path, monkeypatch):
    """Its token leaves the held set only after its lock is gone: a thread acquiring meanwhile is refused or wins a
    free directory, never takes over a lock that is about to be unlinked (two owners: a reviewer's interleaving)."""
    first = lock(tmp_path, job_id="job-a")
    first.acquire()
    seen: list[str] = []
    real_read = OwnerLock._read

    def read_during_release(self, path):  # type: ignore[no-untyped-def]
        result = real_read(self, path)
        if self is first and not seen:  # the releaser has read its lock and is about to unlink it
            try:
                lock(tmp_path, on_takeover=lambda said: seen.append(said)).acquire()
                seen.append("won")
            except DirectoryInUseError:
                seen.append("refused")
        return result

    monkeypatch.setattr(OwnerLock, "_read", read_during_release)
    first.release()
    assert seen == ["refused"]
    assert list(tmp_path.iterdir()) == []


def test_a_takeover_that_never_finishes_is_named_once_the_wait_is_over(tmp_path):
    plant(tmp_path, pid=dead_pid(), process_start=None)
    claimant = replace(Owner.me("job-c", 0), pid=os.getppid(), process_start=process_start_ticks(os.getppid()))
    claim_of(tmp_path).write_bytes(claimant.to_bytes())  # a live process that never finishes its takeover
    started = time.monotonic()
    with pytest.raises(DirectoryInUseError, match=r"taking over its stale lock .* without finishing .*takeover-\*"):
        lock(tmp_path, heartbeat_s=0.5, stale_after_s=1.0).acquire()
    assert 1.5 < time.monotonic() - started < 10
