"""The background checkpoint writer: DCP write, atomic commit, manifest, ``latest``, retention.

One worker thread, at most one save in flight. Why our own thread around ``dcp.save``
rather than ``dcp.async_save``: the commit protocol (fsync, manifest with checksums, rename,
``latest``, retention that never deletes the newest complete checkpoint) must run after the
write and in order with it, and ``async_save``'s default stager copies the whole state again
per call (see staging.py). Under ETTStrategy every rank's worker joins the DCP collectives on
a dedicated gloo group, so they never interleave with training's collectives.

A background write still takes CPU from training; two measures keep it small (together
they took the training time a 1 GiB save costs from ~2.8 s to ~0.9 s here, below DCP's own
``async_save``; benchmarks/checkpoint_cost.py): torch.save's redundant zip CRC is off in this
thread (see :func:`_skip_zip_crc_in_writer_threads`), and each file leaves the page cache once
checksummed (:func:`lightning_ett.durable.manifest.crc32_of`): cached checkpoint pages made
every later write slower and would evict the training data's pages.

Order of a save of step ``s`` (names from :mod:`lightning_ett.checkpoint.layout`):

1. every rank: copy the parameters and optimizer states into the staging buffers (the late
   half of the snapshot, see staging.py); ``dcp.save`` into ``step-<s>.tmp`` (DCP fsyncs
   each file; rank 0 writes ``.metadata`` after all ranks have written); wait for the training
   thread's verdict on the snapshot and agree that no rank's is void (a void one is deleted,
   never committed);
2. rank 0: ``lightning.pt`` (write, fsync), for a delta ``delta-index.json`` (where each rank's
   rows lie), ``manifest.json`` with sizes and CRC-32s (fsync),
   rename ``step-<s>.tmp`` → ``step-<s>``, fsync the parent, replace ``latest``, delete the
   oldest checkpoints beyond ``keep_last_n`` — only ever older than the one just committed;
3. rank 0 tells every rank whether the commit succeeded, so a failure raises everywhere.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_ett.checkpoint import dcp_io, delta
from lightning_ett.checkpoint import layout as fmt
from lightning_ett.checkpoint.chain import Rebase
from lightning_ett.checkpoint.staging import Snapshot
from lightning_ett.durable.commit import discard_unfinished, retire, temp_path
from lightning_ett.durable.errors import ExplainedError, explain
from lightning_ett.durable.files import atomic_write_text, remove_path
from lightning_ett.patching import Patches


class CheckpointWriteError(ExplainedError):
    """A background checkpoint write failed; raised on the training thread."""


class CommittedUnconfirmedError(CheckpointWriteError):
    """Rank 0 committed a complete checkpoint, but a rank stopped before it was told: the checkpoint is good (every
    rank had written its part), the job cannot go on without that rank. Not called a failed write."""


@dataclass(frozen=True)
class WriteResult:
    step: int
    path: Path
    seconds: float  # background time, from the start of the write to the commit
    bytes: int
    boundary_s: float  # the training thread's snapshot at the due step's boundary
    settle_s: float = 0.0  # its wait for the late copy, inside the next step (which the cadence times too)
    overlapped_bytes: int = 0  # of the staged bytes, those copied while the next step ran
    incremental: bool = False  # a delta: the sharded tensors' changed rows only
    rows_changed: int = 0  # (all ranks, deltas only) rows written of the rows compared
    rows_compared: int = 0
    delta_bytes: int = 0  # (deltas only) its row files and their index: what a restore of a chain reads of it
    over_budget: bool = False  # staged as a delta, written full: its changed rows outgrew the chain's restore bound
    rebased: bool = False  # (deltas only) a rebase: every row changed since the chain's full save, built on it alone
    since_full_bytes: int = 0  # (deltas only, all ranks) the bytes a rebase would have held at this save

    @property
    def blocked_s(self) -> float:
        """What the save cost the training thread, for the report."""
        return self.boundary_s + self.settle_s


_writer_thread = threading.local()
_VOID = object()  # _write's answer for a snapshot dropped before its commit (no base for the next delta)


class _ZipCrcSkip:
    """The getter patch, shared by every writer of the process: installed by the first, undone by the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._patches = Patches()

    def acquire(self) -> None:
        with self._lock:
            self._users += 1
            if self._users == 1:
                _skip_zip_crc_in_writer_threads(self._patches)

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._patches.undo()


_ZIP_CRC_SKIP = _ZipCrcSkip()


def _skip_zip_crc_in_writer_threads(patches: Patches) -> None:
    """Make ``torch.save`` skip its zip CRC-32 in our writer threads only, until ``patches`` are undone.

    DCP serializes each tensor with ``torch.save``, whose zip records carry a CRC-32 that
    ``torch.load`` never checks; computing it was ~75 % of DCP's write CPU here (0.7 of
    0.9 s per GiB), CPU that a background write takes from training. Our manifest carries a
    CRC-32 of every file that *is* checked on resume, so the zip one is redundant. torch's
    switch (``torch.serialization.set_crc32_options``) is process-wide; this wraps its getter
    so that other threads' ``torch.save`` calls are unaffected.
    """
    from torch import serialization

    original = serialization.get_crc32_options

    def get_crc32_options() -> bool:
        return False if getattr(_writer_thread, "active", False) else original()

    patches.setattr(serialization, "get_crc32_options", get_crc32_options)


def _write_delay(incremental: bool) -> float:
    """Fault injection for tests: ``LIGHTNING_ETT_FAULT_WRITE_DELAY_S`` holds every save between its data and its
    commit (only deltas with ``LIGHTNING_ETT_FAULT_WRITE_DELAY_KIND=delta``)."""
    if os.environ.get("LIGHTNING_ETT_FAULT_WRITE_DELAY_KIND") == "delta" and not incremental:
        return 0.0
    return float(os.environ.get("LIGHTNING_ETT_FAULT_WRITE_DELAY_S", "0") or 0)


class CheckpointWriter:
    """At most one save in flight, each in its own daemon thread.

    Daemon threads, not a ThreadPoolExecutor: the interpreter joins executor threads at exit,
    so a write stuck in a collective with a dead peer would hang a crashed job for the whole
    process-group timeout. A write killed at exit leaves only a ``.tmp`` directory, which is
    never selected. Errors stay in the save's Future until the callback collects them.
    """

    def __init__(self, root: Path, rank: int, collective: bool, group: Any | None, keep_last_n: int | None,
                 device: torch.device | None = None) -> None:
        self.root = root
        self.rank = rank
        self.collective = collective  # every rank writes its shards (ETTStrategy); else rank 0 writes all
        self.group = group
        self.keep_last_n = keep_last_n
        self.device = device
        _ZIP_CRC_SKIP.acquire()
        self._closed = False
        self._future: Future[WriteResult | None] | None = None
        self._reported: Future[WriteResult | None] | None = None
        self._retention_lock = threading.Lock()
        self._chain: list[dict[str, Any]] = []  # rank 0: the last committed checkpoint's chain, itself last
        self._since_full = delta.RowsSinceFull()  # every rank: its rows changed since the chain's full save
        #: more fields for every manifest rank 0 commits (AsyncCheckpoint's ``began``: the job and the fit's ckpt_path)
        self.manifest_fields: dict[str, Any] = {}

    def status(self) -> tuple[bool, BaseException | None]:
        """(a save is in flight, the error of the last save if it failed) — from one look at it."""
        future = self._future
        if future is None:
            return False, None
        if not future.done():
            return True, None
        return False, future.exception()

    @property
    def busy(self) -> bool:
        return self.status()[0]

    def submit(self, snapshot: Snapshot, step: int, boundary_s: float = float("nan"),
               on_committed: Callable[[Snapshot], None] | None = None, delta_budget: float | None = None,
               rebase: Rebase | None = None) -> None:
        """Start writing ``snapshot`` (callers have agreed across ranks that no save is in flight).

        A snapshot with a base (``snapshot.previous``) is written as a delta of the last checkpoint
        this writer committed — or, if its rows, summed over the ranks, exceed ``delta_budget`` bytes,
        as a rebase where ``rebase`` says it pays, else in full; ``on_committed`` runs on every rank once
        the checkpoint is committed. Every rank must pass the same ``delta_budget`` and ``rebase``.
        """
        assert not self.busy, "at most one save in flight"
        future: Future[WriteResult | None] = Future()

        def run() -> None:
            _writer_thread.active = True
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # a new thread starts on cuda:0, not this rank's GPU
            try:
                result = self._write(snapshot, step, boundary_s, delta_budget, rebase)
                if result is not _VOID and on_committed is not None:
                    on_committed(snapshot)
                future.set_result(None if result is _VOID else result)
            except BaseException as e:  # noqa: BLE001 - delivered to the training thread through the Future
                future.set_exception(e)

        self._future = future
        threading.Thread(target=run, name=f"ett-checkpoint-writer-{step}", daemon=True).start()

    def poll(self) -> WriteResult | None:
        """The result of a save that finished since the last poll (once), without blocking."""
        future = self._future
        if future is None or not future.done() or future is self._reported:
            return None
        self._reported = future
        return None if future.exception() is not None else future.result()

    def wait(self, timeout: float | None = None) -> WriteResult | None:
        """Block until the save in flight (if any) is committed; raise :class:`CheckpointWriteError` if it failed.

        Returns its result unless :meth:`poll` or an earlier ``wait`` already did.
        """
        future = self._future
        if future is None:
            return None
        error = future.exception(timeout=timeout)
        if error is not None:
            self._future = None  # raised once
            message = str(error) if isinstance(error, CheckpointWriteError) else explain(error, self.root)
            if isinstance(error, CommittedUnconfirmedError):  # the type kept: callers tell it from a failed write
                raise CommittedUnconfirmedError(f"A rank stopped at the end of a background checkpoint save: {message}") \
                    from error
            raise CheckpointWriteError(f"The background checkpoint write failed: {message}") from error
        if future is self._reported:
            return None
        self._reported = future
        return future.result()

    def close(self) -> None:
        """Give back the process-wide getter patch (undone when the process's last writer closes)."""
        if not self._closed:
            self._closed = True
            _ZIP_CRC_SKIP.release()

    # ------------------------------------------------------------------ worker thread
    def _write(self, snapshot: Snapshot, step: int, boundary_s: float, delta_budget: float | None,
               rebase: Rebase | None = None) -> WriteResult | None | object:
        """Write and commit; returns the result (rank 0), ``None`` (other ranks) or ``_VOID`` (dropped, not committed)."""
        start = time.perf_counter()
        final = self.root / fmt.checkpoint_name(step)
        tmp = temp_path(final)
        snapshot.copy_late()
        rows = (0, 0)
        incremental = attempted = snapshot.previous is not None
        try:
            snapshot.wait_copied()
            state = snapshot.state["dcp"]
            checksums: dict[str, tuple[int, int]] = {}
            delta_fields: dict[str, Any] | None = None
            if incremental:  # the sharded tensors' changed rows, the rest in full (unless the rows are too many)
                incremental, rows, checksums, delta_fields = self._write_rows(snapshot, tmp, delta_budget, rebase)
                if incremental:
                    state = delta.without_sharded(state)
            checksums.update(dcp_io.write(state, tmp, self.group, collective=self.collective, staged=True))
        except BaseException as e:
            said = explain(e, tmp)
            discard_unfinished(tmp)  # (a collective write's other ranks fail on it too: the save failed anyway)
            raise CheckpointWriteError(f"writing checkpoint {str(final)!r} failed: {said}") from e
        valid, checksums, rows = self._agree_after_write(snapshot, checksums, rows)
        if not valid:
            if self.rank == 0:
                remove_path(tmp)  # changed before it was copied (on some rank): AsyncCheckpoint saves the next step
            return _VOID
        error: str | None = None
        nbytes = delta_bytes = 0
        if delay := _write_delay(snapshot.previous is not None):
            time.sleep(delay)  # data files written, not committed: where a crash hurts most
        if self.rank == 0:
            try:
                nbytes, delta_bytes = self._commit(tmp, final, snapshot.state["meta"], step, checksums, delta_fields)
            except Exception as e:
                error = explain(e, tmp)
                discard_unfinished(tmp)
                if not self.collective or self.group is None:
                    raise CheckpointWriteError(f"committing checkpoint {str(final)!r} failed: {error}") from e
        if self.collective and self.group is not None:
            status = [error]
            try:
                dist.broadcast_object_list(status, src=0, group=self.group)
            except Exception as e:  # a rank died: rank 0 knows whether it committed, the others do not
                if self.rank == 0 and error is None:  # every rank had written its part (agreed above): complete
                    raise CommittedUnconfirmedError(
                        f"checkpoint {str(final)!r} is complete (every rank wrote its part and rank 0 committed it; "
                        f"a resume starts from it), but another rank stopped before it was told: {explain(e)}") from e
                if self.rank == 0:  # its own commit failed, and a rank stopped too
                    raise CheckpointWriteError(f"rank 0 could not commit checkpoint {str(final)!r}: {error}; and a rank "
                                               f"stopped: {explain(e)}") from e
                raise CheckpointWriteError(f"checkpoint {str(final)!r} may have been committed by rank 0 (a resume takes "
                                           f"it only if its manifest is complete), but the ranks could not confirm it "
                                           f"to each other: {explain(e)}") from e
            if status[0] is not None:
                raise CheckpointWriteError(f"rank 0 could not commit checkpoint {str(final)!r}: {status[0]}")
        if not incremental:
            self._since_full.clear()  # committed on every rank (or by the only writer): a new chain starts here
        if self.rank != 0:
            return None
        fields = delta_fields or {}
        return WriteResult(step, final, time.perf_counter() - start, nbytes, boundary_s, snapshot.settle_wait_s,
                           snapshot.late_bytes, incremental, *rows, delta_bytes, attempted and not incremental,
                           bool(fields.get("rebase")), int(fields.get("since_full_bytes", 0)))

    def _all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (this rank's alone without a group)."""
        if not (self.collective and self.group is not None):
            return [value]
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, value, group=self.group)
        return everyone

    @staticmethod
    def _raise_if_any_failed(everyone: list[tuple[str | None, int]], what: str) -> None:
        failed = [(rank, said) for rank, (said, _) in enumerate(everyone) if said is not None]
        if failed:
            raise CheckpointWriteError(f"rank {failed[0][0]} could not {what} its rows: {failed[0][1]}")

    def _write_rows(self, snapshot: Snapshot, tmp: Path, budget: float | None, rebase: Rebase | None = None
                    ) -> tuple[bool, tuple[int, int], dict[str, tuple[int, int]], dict[str, Any] | None]:
        """This rank's changed rows into ``tmp``, agreed with every rank: all fine and within ``budget``?

        Returns (a delta after all, this rank's (rows changed, rows compared), its file's checksum, and
        on rank 0 the delta's fields: ``tracked``, the row-tracked tensors' key paths of every rank (each
        rank holds its own tables' optimizer state), ``index``, where each rank's file's records lie
        (:func:`delta.spans`), so that a restore opens only the files that hold its rows, ``rebase`` and
        ``since_full_bytes``).
        The rows' size is agreed before they are written: rows over budget make the save a rebase where
        ``rebase`` says it pays (every rank decides alike from the gathered sizes), else a full one on
        every rank (the restore bound holds), and nothing is written for them. Whether every rank
        wrote its rows is agreed before DCP's collective write, so a rank that failed (out of memory,
        disk full) fails the save on every rank instead of leaving them in the collective.
        """
        error: str | None = None
        records: list[Any] = []
        nbytes, since_bytes, rows, sums, spans = 0, -1, (0, 0), {}, []
        state = snapshot.state["dcp"]
        if rebase is None:
            self._since_full.invalidate()  # no rebase asked for (full_every_n_saves): no marks kept, none trusted
        try:
            records, changed, compared = delta.diff(state, snapshot.previous or {},
                                                    self._since_full if rebase is not None else None)
            nbytes, rows = delta.records_nbytes(records), (changed, compared)
            since_bytes = self._since_full.nbytes(state) if self._since_full.valid else -1
        except Exception as e:  # noqa: BLE001 - agreed below, raised on every rank
            error = explain(e, tmp)
        everyone = self._all_gather((error, (nbytes, since_bytes)))
        self._raise_if_any_failed(everyone, "compare")
        total = sum(n for _, (n, _) in everyone)
        since_total = -1 if any(b < 0 for _, (_, b) in everyone) else sum(b for _, (_, b) in everyone)
        rebased = False
        if budget is not None and total > budget:
            if rebase is None or since_total < 0 or not rebase.pays(since_total, total):
                return False, (0, 0), {}, None  # the chain would outgrow its bound: this save is full (on every rank)
            rebased = True  # every row changed since the full save, built on it alone: the chain restarts short
            records = []  # the interval's rows, freed before the rebase's are gathered (peak: one set, not two)
            try:
                records = self._since_full.records(state)
                nbytes = delta.records_nbytes(records)
            except Exception as e:  # noqa: BLE001 - agreed below, raised on every rank
                error = explain(e, tmp)
        try:
            if error is None:
                spans = delta.spans(records)
                tmp.mkdir(parents=True, exist_ok=True)
                sums = delta.write(records, tmp, self.rank)
        except Exception as e:  # noqa: BLE001 - agreed below, raised on every rank
            error = explain(e, tmp)
        finally:
            del records  # the gathered rows: freed before DCP's write
        self._raise_if_any_failed(self._all_gather((error, nbytes)), "write")
        # Rank 0 alone writes the manifest and the index: only it gets every rank's keys and spans.
        ours = (sorted(list(key) for key, _ in delta.sharded_leaves(snapshot.state["dcp"])), self.rank, spans)
        gathered: list[Any] | None = [ours]
        if self.collective and self.group is not None:
            gathered = [None] * dist.get_world_size(self.group) if dist.get_rank(self.group) == 0 else None
            dist.gather_object(ours, gathered, group=self.group, group_dst=0)
        if gathered is None:
            return True, rows, sums, {}
        tracked = sorted({tuple(key) for keys, _, _ in gathered for key in keys})
        index = {delta.DELTA_FILE.format(rank=rank): where for _, rank, where in gathered}
        return True, rows, sums, {"tracked": [list(key) for key in tracked], "index": index, "rebase": rebased,
                                  "since_full_bytes": max(since_total, 0)}

    def _agree_after_write(self, snapshot: Snapshot, checksums: dict[str, tuple[int, int]], rows: tuple[int, int]
                           ) -> tuple[bool, dict[str, tuple[int, int]], tuple[int, int]]:
        """Wait for the training thread's verdict on the snapshot; with a collective writer, agree on every rank's
        and hand rank 0 every rank's file checksums and delta row counts (one collective)."""
        valid = snapshot.valid()
        if not (self.collective and self.group is not None):
            return valid, checksums, rows
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, (valid, checksums, rows), group=self.group)
        merged = {name: summed for _, sums, _ in everyone for name, summed in sums.items()}
        total = (sum(r[0] for _, _, r in everyone), sum(r[1] for _, _, r in everyone))
        return all(ok for ok, _, _ in everyone), merged, total

    def _commit(self, tmp: Path, final: Path, meta: dict[str, Any], step: int, checksums: dict[str, tuple[int, int]],
                delta_fields: dict[str, Any] | None = None) -> tuple[int, int]:
        """Make ``tmp`` the durable checkpoint ``final``; returns its size in bytes, and that of its delta files.

        A delta (``delta_fields``: see :meth:`_write_rows`) names its chain in its manifest: the last
        checkpoint this writer committed and that one's chain; a rebase, the chain's full save alone.
        """
        is_delta = delta_fields is not None
        assert not is_delta or self._chain, "a delta needs a committed checkpoint to build on"
        extra = dict(self.manifest_fields) or None
        builds_on = self._chain[:1] if delta_fields is not None and delta_fields.get("rebase") else self._chain
        if delta_fields is not None:
            extra = {**(extra or {}), "kind": "delta", "chain": builds_on, "tracked": delta_fields["tracked"],
                     "rebase": bool(delta_fields.get("rebase"))}
            checksums = {**checksums, **delta.write_index(delta_fields["index"], tmp)}
        # The same step from an abandoned line is replaced: moved aside until the new one is in place.
        manifest = fmt.commit_checkpoint(tmp, final, meta, step, known=checksums, extra=extra)
        self._chain = [*(builds_on if is_delta else []), {"name": final.name, "seq": manifest["seq"]}]
        atomic_write_text(self.root / fmt.LATEST_FILE, final.name + "\n")
        self._apply_retention()  # the checkpoint is durable now: a failed deletion is a warning, never a failed save
        files = manifest["files"]
        return sum(f["bytes"] for f in files.values()), sum(f["bytes"] for n, f in files.items()
                                                          if fnmatch(n, delta.DELTA_GLOB) or n == delta.INDEX_FILE)

    def apply_retention_in_background(self) -> None:
        """Apply retention now, in a thread of its own (after ModelPublisher released a pinned checkpoint)."""

        threading.Thread(target=self._apply_retention, name="ett-checkpoint-retention", daemon=True).start()

    def _apply_retention(self) -> None:
        """Keep the ``keep_last_n`` most recently committed (listed under the lock: the commit's pass and a
        release's pass never work from a stale listing, nor delete at once).

        A failure is a warning, never a failed save or training error: the next pass tries again.
        """
        if self.keep_last_n is None:
            return
        try:
            with self._retention_lock:
                for entry in fmt.to_delete(fmt.committed(self.root), self.keep_last_n):
                    retire(entry.path)
        except OSError as e:
            warnings.warn(f"AsyncCheckpoint: could not delete old checkpoints in {str(self.root)!r}: {explain(e)}",
                          stacklevel=1)
