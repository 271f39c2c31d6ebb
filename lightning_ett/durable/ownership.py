"""One live owner per directory: a lock file that names its owner, taken over once the owner is gone.

Why: two jobs writing one run directory interleave their ledgers, and two jobs writing one
checkpoint directory resume from and overwrite each other's checkpoints — with no error. A
second owner must fail at once, naming the first (job, host, pid), and a crashed owner must
not block the next one.

The lock is a small JSON file inside the directory: job id, host, pid, process start, pid
namespace, attempt, acquired time and a unique token. It is created by writing a uniquely
named temp file and ``os.link``-ing it to the lock's name: a link fails if the name exists,
atomically, so of two acquirers exactly one wins. A lock that exists belongs to:

* a live owner on this host (same hostname and pid namespace): its pid exists, is no zombie and
  started when the lock says (a reused pid is another process) — the acquirer is refused;
* a live owner on another host: it refreshes the lock's mtime every :data:`HEARTBEAT_S` from a
  daemon thread, and a lock whose mtime is older than :data:`STALE_AFTER_S` is stale;
* an owner on another host that a peer declared gone (:func:`declare_gone`: node 0's launcher,
  which heard that node's heartbeat stop) and whose lock has not been refreshed for three heartbeats
  (:attr:`OwnerLock.gone_after_s`, 30 s): taken over with a warning, without waiting out the 60 s —
  a scheduler replaces a lost node on another host within seconds. An owner the peer only lost
  touch with (a partition between the nodes, not between the node and the file server) keeps
  refreshing its lock (retrying a failed refresh after 1 s) and is refused, declared or not.
  A *patient* acquirer (``acquire(patience_s=...)``: a replacement started before the loss was
  noticed) polls an owner on another host until it is declared gone or goes stale; once its
  patience is spent, it waits on for the staleness of an owner that never refreshed meanwhile,
  and is refused at once by one that did;
* no one alive: taken over with a warning. The acquirer first claims the takeover of that very
  lock: a ``<lock>.takeover-<hash of its content>`` file, linked like the lock, so one claimant
  wins. Under the claim it reads the lock again and, if it is still the one judged stale, renames
  its own complete lock file over it: the lock never disappears, so no acquirer slips in between
  (setting the stale lock aside first and putting back a newer one let two acquirers win). A
  claimant that died mid-takeover is judged like an owner (its pid; on another host, its claim's
  age) and passed by claiming the next name of a chain keyed by its claim.

On a filesystem shared by several nodes (NFS, Lustre, GPFS) this relies on: ``link`` and
``rename`` within one directory being atomic (NFS v3+; a link or rename whose reply was lost on a
retransmit is recognized by the temp file's link count or the lock's content); close-to-open consistency (the lock
is opened before its mtime is read, which revalidates NFS's attribute cache); ``utime`` reaching
the file server within a heartbeat; and every host's clock agreeing with the file server's to
well within :data:`STALE_AFTER_S` (a lock's age is the reader's clock minus the server's mtime).
Where hard links are not supported, ``O_EXCL`` creation is used instead.

Standard library only: ``durable`` is the foundation of the package.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning_ett.durable.procfs import process_alive, process_start_ticks

#: Lock file of a checkpoint directory (``AsyncCheckpoint``).
CHECKPOINT_OWNER_FILE = ".ett-owner"
#: Lock file of a publish directory (``ModelPublisher``): another name, as one directory may serve as both.
PUBLISHER_OWNER_FILE = ".ett-publisher-owner"
#: Seconds between an owner's heartbeats (the lock's mtime).
HEARTBEAT_S = 10.0
#: A lock not refreshed for this long belongs to no one (its owner, on another host, is gone).
STALE_AFTER_S = 60.0
_RETRIES = 20
_CLAIM_CHAIN = 8  # claimants that died mid-takeover passed at most (each needs a dead process)
_CLAIM_POLL_S = 0.02  # a live claimant's takeover takes milliseconds
_UNREADABLE_GRACE_S = 2.0  # a lock still being written (O_EXCL fallback) is empty for a moment
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOSYS}

# Tokens of the locks held by live OwnerLock objects of this process (a lock naming this process
# but not held here was left by an earlier holder in it, which is gone).
_held: set[str] = set()
_held_lock = threading.Lock()


def run_dir_owner_file(node_rank: int) -> str:
    """Lock file of a run directory, one per node: several nodes' launchers share one run directory."""
    return f".ett-owner-node-{node_rank:05d}"


class DirectoryInUseError(RuntimeError):
    """A directory already has a live owner: another job (or another process of this one) writes it."""


class StaleOwnerWarning(UserWarning):
    """A lock left by an owner that is gone was taken over."""


def _pid_namespace() -> str | None:
    """Containers may share a hostname but not their pids: a pid is only checked within its namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


@dataclass(frozen=True)
class Owner:
    """What a lock file says about its owner."""

    job_id: str
    host: str
    pid: int
    process_start: int | None  # clock ticks since boot (pid reuse check); None where unknown
    pid_namespace: str | None
    attempt: int | None
    acquired: float
    token: str

    @classmethod
    def me(cls, job_id: str, attempt: int | None) -> Owner:
        pid = os.getpid()
        return cls(job_id, socket.gethostname(), pid, process_start_ticks(pid), _pid_namespace(), attempt,
                   time.time(), uuid.uuid4().hex)

    @classmethod
    def parse(cls, data: bytes) -> Owner | None:
        try:
            raw = json.loads(data)
            return cls(str(raw["job_id"]), str(raw["host"]), int(raw["pid"]), raw.get("process_start"),
                       raw.get("pid_namespace"), raw.get("attempt"), float(raw["acquired"]), str(raw["token"]))
        except (ValueError, KeyError, TypeError):
            return None

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self)) + "\n").encode()

    def same_host(self, other: Owner) -> bool:
        return self.host == other.host and self.pid_namespace == other.pid_namespace

    def describe(self) -> str:
        attempt = f", attempt {self.attempt}" if self.attempt is not None else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.acquired))
        return f"job {self.job_id!r} (pid {self.pid} on host {self.host!r}{attempt}, since {since})"


class OwnerLock:
    """Own ``directory`` through its lock file ``name`` while this process works in it.

    Args:
        directory: the directory owned (created if missing).
        name: the lock file's name inside it.
        job_id, attempt: who owns it, as the error seen by the next one will say.
        what: how the error names the directory, e.g. ``"--run-dir '/runs/a'"``.
        fix: what the refused user should do, appended to the error.
        earlier_attempts_are_stopped: an owner of the same job with an earlier attempt is this
            job's previous attempt, which its launcher stopped: taken over quietly (unless it is a
            live process on this host). Its heartbeat may still look fresh when rank 0 moved hosts.
        on_takeover: called with a sentence when a stale owner is taken over (default: a
            :class:`StaleOwnerWarning`).
        heartbeat_s, stale_after_s: how often the owner refreshes its lock, and how long an unrefreshed lock
            on another host is still alive; one declared gone is alive for ``3 * heartbeat_s``.
    """

    def __init__(self, directory: str | os.PathLike, name: str, job_id: str, attempt: int | None = None,
                 what: str | None = None, fix: str = "", earlier_attempts_are_stopped: bool = False,
                 on_takeover: Callable[[str], None] | None = None, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S) -> None:
        if not stale_after_s > heartbeat_s > 0:
            raise ValueError(f"OwnerLock(heartbeat_s={heartbeat_s!r}, stale_after_s={stale_after_s!r}): expected "
                             "0 < heartbeat_s < stale_after_s.")
        self.directory = Path(directory)
        self.path = self.directory / name
        self.job_id, self.attempt = job_id, attempt
        self.what = what or f"directory {str(self.directory)!r}"
        self.fix = fix
        self.earlier_attempts_are_stopped = earlier_attempts_are_stopped
        self.on_takeover = on_takeover or _warn
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.gone_after_s = min(3 * heartbeat_s, stale_after_s)
        self.owner: Owner | None = None  # set while held
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of our lock file
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ acquire / release
    def acquire(self, patience_s: float = 0.0, on_wait: Callable[[str], None] | None = None) -> Owner | None:
        """Own the directory, or raise :class:`DirectoryInUseError` naming its live owner.

        ``patience_s``: how long an owner on another host that looks alive is given to be declared gone
        (:func:`declare_gone`) or to go stale before the refusal — a replacement for a lost node started
        before its peers noticed the loss; ``on_wait`` is told once, with a sentence, that it waits.
        Returns the stale owner that was taken over, if any.
        """
        if self.owner is not None:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        me = Owner.me(self.job_id, self.attempt)
        with _held_lock:
            _held.add(me.token)  # before it exists: another thread of this process must not judge it abandoned
        try:
            return self._acquire(me, _Patience(patience_s, self.stale_after_s, self.what, on_wait))
        except BaseException:
            with _held_lock:
                _held.discard(me.token)
            raise

    def _acquire(self, me: Owner, patience: _Patience) -> Owner | None:
        data = me.to_bytes()
        tries = 0
        claim_wait_until: float | None = None
        while tries < _RETRIES:
            tries += 1
            if self._create(self.path, data):
                self._held(me)
                return None
            seen = self._read(self.path)
            if seen is None:
                continue  # released meanwhile: try again
            raw, age_s = seen
            current = Owner.parse(raw)
            if current is None:
                if age_s < _UNREADABLE_GRACE_S:
                    time.sleep(0.1)  # being written (O_EXCL fallback)
                    continue
                reason, quiet = f"its lock file is unreadable ({raw[:80]!r})", False
            else:
                reason, quiet = self._judge(current, me, age_s)
                if reason is None:
                    if current.same_host(me) or not patience.waited(current, age_s):
                        raise DirectoryInUseError(self._refusal(current, me, age_s, patience.refreshed))
                    tries -= 1  # (a wait is no lost race)
                    continue
            outcome = self._take_over(raw, data, me)
            if outcome == "won":
                self._held(me)
                if not quiet:
                    who = current.describe() if current is not None else "an unknown owner"
                    self.on_takeover(f"{self.what}: taking over from {who}: {reason}.")
                return current
            if outcome == "busy":  # another acquirer is taking it over: see what it leaves
                claim_wait_until = claim_wait_until or time.monotonic() + self.stale_after_s + 1.0
                if time.monotonic() >= claim_wait_until:
                    raise DirectoryInUseError(
                        f"{self.what}: another process has been taking over its stale lock {str(self.path)!r} for "
                        f"{self.stale_after_s + 1.0:.0f} s without finishing (its claim: "
                        f"{self.path!s}.takeover-*, naming that process). If that process is gone, delete the "
                        "claim file and start again.")
                tries -= 1
                time.sleep(_CLAIM_POLL_S)
        raise DirectoryInUseError(f"{self.what}: could not take its lock {str(self.path)!r} after {_RETRIES} tries: "
                                  "other processes keep acquiring it. Is another job starting into it?")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours (a newer owner's stays)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        owner, self.owner = self.owner, None
        if owner is None:
            return
        seen = self._read(self.path)
        if seen is not None and Owner.parse(seen[0]) == owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        with _held_lock:  # only now: until the unlink, another thread here must judge the lock alive, not abandoned
            _held.discard(owner.token)
        if _declared_gone(self.path, owner.token) is not None:  # it was alive after all (e.g. a partition healed)
            withdraw_gone(self.directory, self.path.name)

    # ------------------------------------------------------------------ the steps
    def _create(self, target: Path, data: bytes) -> bool:
        """Create ``target`` with ``data`` if it does not exist: link a complete temp file to its name."""
        temp = self._write_temp(data)
        try:
            try:
                os.link(temp, target)
                return True
            except FileExistsError:
                return _linked_anyway(temp)
            except OSError as err:
                if _linked_anyway(temp):
                    return True
                if err.errno not in _NO_LINKS:
                    raise
            return self._create_exclusive(target, data)
        finally:
            with contextlib.suppress(OSError):
                temp.unlink()

    def _create_exclusive(self, target: Path, data: bytes) -> bool:
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _write_temp(self, data: bytes) -> Path:
        temp = self.directory / f"{self.path.name}.{uuid.uuid4().hex}.tmp"
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return temp

    def _read(self, path: Path) -> tuple[bytes, float] | None:
        """A lock's (or claim's) content and age in seconds (opened first: revalidates NFS's cached attributes)."""
        try:
            with open(path, "rb") as f:
                mtime = os.fstat(f.fileno()).st_mtime
                return f.read(64 * 1024), time.time() - mtime
        except (FileNotFoundError, NotADirectoryError):  # (its directory replaced by a file: no lock there either)
            return None

    def _judge(self, current: Owner, me: Owner, age_s: float) -> tuple[str | None, bool]:
        """Why ``current`` is no live owner, and whether to take over quietly; ``(None, _)`` if it is alive."""
        previous = (self.earlier_attempts_are_stopped and current.job_id == me.job_id
                    and current.attempt is not None and me.attempt is not None and current.attempt < me.attempt)
        if current.same_host(me):
            if current.pid == me.pid and current.process_start == me.process_start:
                with _held_lock:
                    held = current.token in _held
                return (None, False) if held else ("its holder in this process is gone", previous)
            if process_alive(current.pid, current.process_start):
                return None, False
            return f"process {current.pid} is gone", previous
        if previous:
            return "it is this job's previous attempt", True
        if age_s < self.stale_after_s:
            gone = _declared_gone(self.path, current.token) if age_s >= self.gone_after_s else None
            return gone, False
        return f"no heartbeat for {age_s:.0f} s (stale after {self.stale_after_s:.0f} s)", False

    def _take_over(self, raw: bytes, data: bytes, me: Owner) -> str:
        """Replace the stale lock ``raw`` with ``data``: ``"won"``, ``"lost"`` (it changed) or ``"busy"``.

        Only the holder of the takeover claim on ``raw`` replaces it, by renaming over it (see the
        module's docstring); claims are removed once the lock no longer holds ``raw``, so a late
        claimant finds it changed.
        """
        key = hashlib.sha256(raw).hexdigest()[:16]
        passed: list[Path] = []  # claims of claimants that died mid-takeover
        for _ in range(_CLAIM_CHAIN):
            claim = self.path.with_name(f"{self.path.name}.takeover-{key}")
            if self._create(claim, data):
                break
            seen = self._read(claim)
            if seen is None:
                return "lost"  # its claimant finished: the lock changed
            claim_raw, age_s = seen
            claimant = Owner.parse(claim_raw)
            alive = age_s < _UNREADABLE_GRACE_S if claimant is None else self._judge(claimant, me, age_s)[0] is None
            if alive:
                return "busy"
            passed.append(claim)
            key = hashlib.sha256(key.encode() + claim_raw).hexdigest()[:16]
        else:
            return "busy"
        try:
            seen = self._read(self.path)
            if seen is None or seen[0] != raw:
                return "lost"
            current = Owner.parse(raw)
            if current is not None and self._judge(current, me, seen[1])[0] is None:
                return "lost"  # judged again with its fresh age: it refreshed its heartbeat meanwhile, it is alive
            self._replace(data)
            return "won"
        finally:
            for done in (claim, *passed):
                with contextlib.suppress(OSError):
                    done.unlink()

    def _replace(self, data: bytes) -> None:
        """Rename a complete lock file over the lock: atomic, and never a moment without a lock."""
        temp = self._write_temp(data)
        try:
            os.rename(temp, self.path)
        except FileNotFoundError:
            seen = self._read(self.path)  # NFS: a rename retransmitted after a lost reply
            if seen is None or seen[0] != data:
                raise
        finally:
            with contextlib.suppress(OSError):
                temp.unlink()

    def _held(self, me: Owner) -> None:
        self.owner = me
        with contextlib.suppress(OSError):
            _gone_marker(self.path).unlink()  # it named the owner taken over, never this one
        try:
            st = os.stat(self.path)
            self._identity = (st.st_dev, st.st_ino)
        except OSError:
            self._identity = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(self._stop,), name="ett-owner-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, stop: threading.Event) -> None:
        """Refresh the lock's mtime, so that other hosts see this owner alive; say so once if it was lost."""
        wait_s = self.heartbeat_s
        while not stop.wait(wait_s):
            wait_s = self.heartbeat_s
            try:
                st = os.stat(self.path)
                if self._identity is not None and (st.st_dev, st.st_ino) != self._identity:
                    raise FileNotFoundError
                os.utime(self.path)
            except FileNotFoundError:
                if not stop.is_set():
                    _warn(f"{self.what}: its lock {str(self.path)!r} was removed or replaced by another process "
                          "while this one owned it; another job may now write into it too.")
                return
            except OSError:
                wait_s = 1.0  # a transient error of a network filesystem: soon again, not a heartbeat later

    def _refusal(self, current: Owner, me: Owner, age_s: float, refreshed: bool = False) -> str:
        if current.same_host(me):
            alive = "alive"
        elif refreshed:
            alive = "alive: it refreshed its lock while this process waited"
        else:
            alive = f"alive or gone for less than {self.stale_after_s:.0f} s: its last heartbeat was {max(age_s, 0):.0f} s ago"
        text = (f"{self.what} is in use by {current.describe()}, which is {alive}. Two owners would write "
                f"into each other's files. {self.fix}".rstrip())
        return (f"{text} (Its lock: {str(self.path)!r}; once that process is gone it is taken over, on another host "
                f"{self.stale_after_s:.0f} s after its last heartbeat, or {self.gone_after_s:.0f} s after it once a "
                "peer declared it gone: a multi-node job's node 0 does when that node stops responding.)")


class _Patience:
    """An acquirer's wait for a live-looking owner on another host to be declared gone or to go stale.

    It polls every second for ``patience_s``; then, if the owner never refreshed its lock meanwhile,
    on until the lock is stale. An owner seen refreshing its lock is alive: no more waiting.
    """

    def __init__(self, patience_s: float, stale_after_s: float, what: str,
                 on_wait: Callable[[str], None] | None) -> None:
        self.until = time.monotonic() + patience_s if patience_s > 0 else 0.0
        self.stale_after_s, self.what, self.on_wait = stale_after_s, what, on_wait
        self.refreshed = False  # the owner waited for refreshed its lock meanwhile: alive
        self._watched: tuple[str, float] | None = None  # (token, mtime) of the owner waited for
        self._extended = self._told = False

    def waited(self, current: Owner, age_s: float) -> bool:
        """Wait a second for ``current`` (its lock ``age_s`` old) and return True, or False: refuse it now."""
        mtime = time.time() - age_s
        if self._watched is None or self._watched[0] != current.token:
            self._watched = (current.token, mtime)
        elif mtime - self._watched[1] > 0.5:
            self.refreshed = True
        if self.refreshed or not self.until:
            return False
        if not self._extended and time.monotonic() + 1.0 >= self.until:
            # Patience spent, and the owner never refreshed its lock meanwhile: it is gone but for the proof.
            self._extended = True
            self.until = time.monotonic() + max(self.stale_after_s - age_s, 0.0) + 1.0
        if time.monotonic() + 1.0 >= self.until:
            return False
        if not self._told and self.on_wait is not None:
            self._told = True
            self.on_wait(f"{self.what} is held by {current.describe()}, its last heartbeat {max(age_s, 0):.0f} s ago; "
                         f"waiting up to {self.until - time.monotonic():.0f} s for it to be declared gone or to go stale")
        time.sleep(1.0)
        return True


def _linked_anyway(temp: Path) -> bool:
    """NFS: a ``link`` retransmitted after a lost reply fails with EEXIST although it succeeded."""
    try:
        return os.stat(temp).st_nlink == 2
    except OSError:
        return False


def _warn(message: str) -> None:
    warnings.warn(message, StaleOwnerWarning, stacklevel=3)


def _gone_marker(lock: Path) -> Path:
    return lock.with_name(lock.name + ".gone")


def declare_gone(directory: str | os.PathLike, name: str, token: str, reason: str) -> Owner | None:
    """Say that the owner holding lock ``name`` with ``token`` is gone, where only a peer can know it (its host died).

    Its lock looks alive for up to :data:`STALE_AFTER_S` after its last heartbeat; declared, it may be
    taken over :attr:`OwnerLock.gone_after_s` after it — only that owner (a lock that names another
    token, e.g. a replacement's that already took over, is left alone), and only while it stays silent.
    Returns the owner declared gone, or ``None`` when the lock does not name ``token``.

    Standard library only, and the marker is written whole (a temp file renamed over it).
    """
    lock = Path(directory) / name
    owner = read_owner(lock)
    if owner is None or owner.token != token:
        return None
    marker = _gone_marker(lock)
    temp = marker.with_name(f"{marker.name}.{uuid.uuid4().hex}.tmp")
    temp.write_text(json.dumps({"token": token, "reason": reason, "declared": time.time()}) + "\n")
    os.replace(temp, marker)
    return owner


def withdraw_gone(directory: str | os.PathLike, name: str) -> None:
    """Take back :func:`declare_gone`: the owner answered again (a partition healed)."""
    with contextlib.suppress(FileNotFoundError):
        _gone_marker(Path(directory) / name).unlink()


def _declared_gone(lock: Path, token: str) -> str | None:
    """Why a peer declared the owner holding ``token`` gone, or ``None`` if no one did."""
    try:
        raw = json.loads(_gone_marker(lock).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("token") != token:
        return None
    return f"a peer declared it gone: {raw.get('reason', 'no reason given')}"


def read_owner(path: str | os.PathLike) -> Owner | None:
    """The owner a lock file names, or ``None`` (no lock, or unreadable)."""
    try:
        return Owner.parse(Path(path).read_bytes())
    except OSError:
        return None


__all__ = ["CHECKPOINT_OWNER_FILE", "PUBLISHER_OWNER_FILE", "DirectoryInUseError", "Owner", "OwnerLock", "StaleOwnerWarning",
           "declare_gone", "read_owner", "run_dir_owner_file", "withdraw_gone"]
