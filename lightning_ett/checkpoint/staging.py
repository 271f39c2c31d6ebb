"""Snapshot a checkpoint into CPU buffers reused from save to save, copying the bulk off the training thread.

A save of step ``s`` must hold the state at ``s``, bit for bit, yet the training loop should
not wait for a copy of every byte. What the next step changes, and when:

* its batch fetch and forward pass change nothing we copy late (see below);
* its backward pass changes the tables when TorchRec fuses their optimizer into backward;
* its ``optimizer.step`` changes the dense parameters and the optimizer's state.

So :meth:`Stager.stage` splits the state at the due step's boundary:

* **now**, on the training thread: the structure, every non-tensor leaf (Lightning's loop and
  callback state, which the next step changes) and every tensor that is *not* the storage of a
  parameter or of an optimizer's state — buffers such as BatchNorm's running statistics, which
  forward updates, and anything else we cannot vouch for;
* **late**, in the writer's thread: the parameters and optimizer states, the bulk of the bytes.
  :meth:`Snapshot.settle` is called on the training thread right before the first mutation
  (AsyncCheckpoint: ``on_before_backward`` with fused tables, else ``on_before_optimizer_step``)
  and waits only for what is still being copied.

Then it checks that the late tensors were not changed before that point: every in-place op
bumps a tensor's version counter, so a changed version means the copy may hold a newer value.
Such a snapshot is never committed (the writer waits for the verdict); AsyncCheckpoint saves again
at the next boundary with those tensors copied at once. (In-place writes through ``.data`` or
raw kernels bump no version: a model that mutates parameters that way in forward needs
``AsyncCheckpoint(overlap_staging=False)``, which copies everything at the boundary.)

On CUDA the late copies go to pinned buffers on a side stream that first waits for an event
recorded on the compute stream at the boundary; ``settle`` makes the compute stream wait for
the copies' event, so the host never blocks and no copy ever runs on the compute stream.

Why not DCP's ``DefaultStager(StagingOptions(use_async_staging=True))``: it copies *everything*
in its thread, so buffers that forward updates and the loop state the next step changes race
with the copy; it cannot tell a caller that something changed too early; and on CUDA its copy
stream does not wait for the compute stream's queued work and its completion is a host-side
future, so the loop must block the host before queueing a mutation. The buffers are built with
DCP's own helper (``_create_cpu_state_dict``, which knows ShardedTensor and DTensor), one per
tensor leaf, and are rebuilt only when those tensors change (an optimizer that creates its
state lazily), never for non-tensor state such as a list in a callback's state that grows.

For incremental saves (``AsyncCheckpoint(incremental=True)``) the stager also keeps the
*base*: the sharded tensors' buffers of the last committed save. A new snapshot's sharded
tensors go into a second set of buffers, so the writer can compare the two and write only the
rows that changed (:mod:`lightning_ett.checkpoint.delta`); once the new save is committed its
buffers become the base (:meth:`Stager.mark_base`). A save that fails or is void leaves the base
as it was, so the next delta is still against what is on disk.
"""

from __future__ import annotations

import copy
import os
import shutil
import threading
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import _create_cpu_state_dict
from torch.distributed.tensor import DTensor

from lightning_ett.checkpoint.delta import is_sharded

#: Where shared memory (``share_memory_``) lives on Linux.
SHARED_MEMORY_DIR = "/dev/shm"


def _leaves(obj: Any) -> Iterable[Any]:
    """The tensor leaves of a state (tensors, ShardedTensors, DTensors), in traversal order."""
    if isinstance(obj, torch.Tensor):  # ShardedTensor and DTensor are tensors too
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _leaves(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _leaves(value)


def _parts(leaf: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors behind one leaf: a ShardedTensor's local shards, a DTensor's local tensor (TorchRec's 2D
    tables: the shards of its local-shards wrapper, which has no storage of its own), or the tensor itself."""
    if isinstance(leaf, ShardedTensor):
        return [shard.tensor for shard in leaf.local_shards()]
    if isinstance(leaf, DTensor):
        return list(leaf._local_tensor.local_shards()) if _wraps_shards(leaf) else [leaf._local_tensor]
    return [leaf]


def _local_tensors(obj: Any) -> Iterable[torch.Tensor]:
    """Every plain tensor this rank holds in ``obj`` (ShardedTensor shards, DTensor local parts), in order."""
    for leaf in _leaves(obj):
        yield from _parts(leaf)


def _signature(state: Any) -> list[tuple[Any, ...]]:
    """Shapes, dtypes and devices of every tensor leaf, in order: equal signatures mean the buffers fit.

    (DCP's ``_check_state_dict_similarity`` would do, but it also copies every tensor.)
    """
    sig: list[tuple[Any, ...]] = []
    for leaf in _leaves(state):
        if isinstance(leaf, ShardedTensor):
            sig.append(("st", tuple(leaf.size()), leaf.dtype, leaf.device.type,
                        tuple((tuple(s.metadata.shard_offsets), tuple(s.tensor.shape)) for s in leaf.local_shards())))
        elif isinstance(leaf, DTensor):
            sig.append(("dt", tuple(leaf.shape), tuple(tuple(p.shape) for p in _parts(leaf)), leaf.dtype, leaf.device.type))
        else:
            sig.append(("t", tuple(leaf.shape), leaf.dtype, leaf.device.type))
    return sig


def state_nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _local_tensors(state))


def storages(objects: Iterable[Any]) -> set[int]:
    """The storage addresses of every tensor in ``objects`` (tensors, state dicts, optimizer states)."""
    return {t.untyped_storage().data_ptr() for obj in objects for t in _local_tensors(obj) if t.numel()}


class _Plan:
    """The staged structure, and which (source, buffer) pairs to copy now and which later.

    Buffers are matched to the state's tensor leaves by position (equal signatures guarantee
    they fit); the structure around them is rebuilt from the state each time, so a list in
    Lightning's callback state that grows from one save to the next costs no new buffers.
    """

    def __init__(self, buffers: list[Any], late_storages: set[int]) -> None:
        self._buffers = iter(buffers)
        self.late_storages = late_storages
        self.now: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.late: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []  # (name, source, buffer, version)

    def pair(self, src: Any, name: str) -> Any:
        if isinstance(src, (ShardedTensor, DTensor)):
            dst = next(self._buffers)
            sources, buffers = _parts(src), _parts(dst)
            for i, (a, b) in enumerate(zip(sources, buffers, strict=True)):
                self._tensor(a, b, f"{name}[shard {i}]" if len(sources) > 1 else name)
            return dst
        if isinstance(src, torch.Tensor):
            dst = next(self._buffers)
            self._tensor(src, dst, name)
            return dst
        if isinstance(src, dict):
            return {k: self.pair(v, f"{name}.{k}" if name else str(k)) for k, v in src.items()}
        if isinstance(src, (list, tuple)):
            items = [self.pair(v, f"{name}[{i}]") for i, v in enumerate(src)]
            return tuple(items) if isinstance(src, tuple) else items
        return copy.deepcopy(src)  # loop counters, hyper-parameters: the next step may change them

    def _tensor(self, src: torch.Tensor, dst: torch.Tensor, name: str) -> None:
        if src.numel() and src.untyped_storage().data_ptr() in self.late_storages:
            self.late.append((name, src, dst, src._version))
        else:
            self.now.append((src, dst))


def _copy_delay() -> float:
    """Fault injection for tests: ``LIGHTNING_ETT_FAULT_STAGE_DELAY_S`` holds the late copy back this long."""
    return float(os.environ.get("LIGHTNING_ETT_FAULT_STAGE_DELAY_S", "0") or 0)


class Snapshot:
    """A staged state: its tensors live in the stager's buffers until the next :meth:`Stager.stage`.

    Two threads: the writer runs :meth:`copy_late`, :meth:`wait_copied`, writes, and commits
    only if :meth:`valid`; the training thread calls :meth:`settle` before it mutates anything.
    """

    def __init__(self, state: dict[str, Any], late: list[tuple[str, torch.Tensor, torch.Tensor, int]],
                 boundary: Any | None, previous: dict[int, Any] | None = None,
                 sharded_buffers: dict[int, Any] | None = None, generation: int = 0) -> None:
        self.state = state
        #: incremental: ``id(staged sharded leaf)`` → the base's buffer of it (None: no base, a full save)
        self.previous = previous
        self.sharded_buffers = sharded_buffers or {}  # leaf index → this snapshot's buffer (the next base)
        self.generation = generation
        self._late = late
        self._boundary = boundary  # CUDA event on the compute stream at the due step's boundary
        self._copied_event: Any | None = None  # CUDA event after the late copies, on the side stream
        self._copied = threading.Event()
        self._copy_error: BaseException | None = None
        self._settled = threading.Event()
        self.changed_early: list[str] = []  # late tensors that changed before settle (the snapshot is void)
        self.changed_storages: set[int] = set()  # their storages: to copy at the boundary from now on
        self.settle_wait_s = 0.0  # what settle() cost the training thread
        self.late_bytes = sum(dst.numel() * dst.element_size() for _, _, dst, _ in late)
        if not late:
            self._copied.set()  # everything was copied at the boundary

    @property
    def copying(self) -> bool:
        """The late copy has not finished (or, on CUDA, not yet been queued)."""
        return not self._copied.is_set()

    def copy_late(self) -> None:
        """Writer thread: copy the parameters and optimizer states into their buffers."""
        if self._copied.is_set():
            return
        try:
            if delay := _copy_delay():
                time.sleep(delay)
            if self._boundary is not None:
                stream = torch.cuda.Stream()  # the writer thread has set this rank's device
                stream.wait_event(self._boundary)  # after every kernel queued before the boundary
                with torch.cuda.stream(stream):
                    for _, src, dst, _ in self._late:
                        dst.copy_(src, non_blocking=True)
                    self._copied_event = torch.cuda.Event()
                    self._copied_event.record(stream)
            else:
                for _, src, dst, _ in self._late:
                    dst.copy_(src)
        except BaseException as e:  # noqa: BLE001 - delivered through settle() and wait()
            self._copy_error = e
        finally:
            self._copied.set()

    def settle(self) -> list[str]:
        """Training thread, before the first mutation: order it after the copies; return what changed too early.

        Idempotent. On CPU it waits for the copy; on CUDA it waits only until the copies are
        queued and makes the compute stream wait for them on the device.
        """
        if self._settled.is_set():
            return self.changed_early
        start = time.perf_counter()
        self._copied.wait()
        if self._copied_event is not None:
            torch.cuda.current_stream().wait_event(self._copied_event)
        changed = [(name, src) for name, src, _, version in self._late if src._version != version]
        self.changed_early = [name for name, _ in changed]
        self.changed_storages = {src.untyped_storage().data_ptr() for _, src in changed}
        self.settle_wait_s = time.perf_counter() - start
        self._settled.set()
        return self.changed_early

    def wait_copied(self) -> None:
        """Writer thread: block until every copy has landed in the buffers (raises the copy's error)."""
        self._copied.wait()
        if self._copy_error is not None:
            raise self._copy_error
        if self._boundary is not None:
            self._boundary.synchronize()  # the copies made at the boundary
        if self._copied_event is not None:
            self._copied_event.synchronize()

    def valid(self) -> bool:
        """Writer thread: block until the training thread has settled it; ``False`` if it is void."""
        self._settled.wait()
        self._late = []  # the copies have landed and been checked: the sources may be freed
        return not self.changed_early


def shared_memory_fits(nbytes: int, where: str = SHARED_MEMORY_DIR) -> bool:
    """Whether ``nbytes`` of staging buffers fit in the shared-memory filesystem, with a 10 % margin."""
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return False
    if nbytes * 1.1 <= free:
        return True
    warnings.warn(f"AsyncCheckpoint: {nbytes / 2**20:.0f} MiB of pinned staging buffers do not fit in {where} "
                  f"({free / 2**20:.0f} MiB free); using the caching pinned allocator instead. In a container, "
                  "raise it (docker --shm-size, a Kubernetes emptyDir with medium: Memory).", stacklevel=3)
    return False


def _wraps_shards(leaf: Any) -> bool:
    """A DTensor over a local-shards wrapper (TorchRec's own ``LocalShardsWrapper`` or torch's copy of it)."""
    local = getattr(leaf, "_local_tensor", None) if isinstance(leaf, DTensor) else None
    return hasattr(local, "local_shards") and hasattr(local, "local_offsets")


def _shards_buffer(leaf: DTensor, pin_memory: bool, share_memory: bool) -> DTensor:
    """A CPU copy's buffer for a DTensor over a local-shards wrapper (TorchRec's 2D tables).

    DCP's ``_create_cpu_state_dict`` would replace the wrapper by one plain tensor of its
    (global-looking) size, losing the shards and their offsets; here each shard gets its own
    buffer and the wrapper is rebuilt around them, with the original DTensor spec (mesh,
    placements, global shape), so DCP writes the same chunks from the copy.
    """
    local = leaf._local_tensor
    shards = _create_cpu_state_dict(dict(enumerate(local.local_shards())), pin_memory=pin_memory,
                                    share_memory=share_memory)
    wrapper = type(local)([shards[i] for i in range(len(shards))], list(local.local_offsets()))
    return DTensor(wrapper, leaf._spec, requires_grad=False)


class Stager:
    """One set of staging buffers, reused by every save (bounded memory: one snapshot at a time)."""

    def __init__(self) -> None:
        self._buffers: list[Any] | None = None
        self._signature: list[tuple[Any, ...]] = []
        self._generation = 0  # bumped at every allocation: a base from older buffers is no base
        self._pinned = self._shared = False
        self._sharded: list[int] = []  # indices of the sharded leaves (tables and their optimizer states)
        self._base: dict[int, Any] = {}  # incremental: their buffers holding the last committed save
        self._spare: dict[int, Any] = {}
        self.nbytes = 0  # staging memory currently held (host RAM, pinned on CUDA)

    @property
    def has_base(self) -> bool:
        """A committed save's sharded tensors are held, so the next save can be a delta against them."""
        return bool(self._sharded) and all(i in self._base for i in self._sharded)

    @property
    def holds_sharded(self) -> bool:
        """The staged state has sharded tensors (tables): only those are written as deltas."""
        return bool(self._sharded)

    def can_diff(self, state: dict[str, Any]) -> bool:
        """A delta of ``state`` against the base is possible: there is one, and its tables still fit their buffers."""
        return self.has_base and self._tables_fit(list(_leaves(state)), _signature(state))

    def _tables_fit(self, leaves: list[Any], signature: list[tuple[Any, ...]]) -> bool:
        """The sharded leaves (tables) are where they were, in the same shapes: their buffers and the base still fit.

        Other tensors may come and go between saves — a callback's state in Lightning's checkpoint data
        (``ModelCheckpoint``'s scores, a metric logged at validation) — without costing the tables'
        buffers or the chain.
        """
        return (self._buffers is not None and [i for i, leaf in enumerate(leaves) if is_sharded(leaf)] == self._sharded
                and all(signature[i] == self._signature[i] for i in self._sharded))

    def stage(self, state: dict[str, Any], late_storages: set[int] | None = None, keep_base: bool = False,
              as_delta: bool = False) -> Snapshot:
        """Copy ``state`` into the buffers: now, except tensors whose storage is in ``late_storages``.

        Those are copied by :meth:`Snapshot.copy_late` (the writer thread); until then the caller
        must not mutate them and must call :meth:`Snapshot.settle` before it does. The caller
        must not stage again before the writer has finished with the previous snapshot
        (AsyncCheckpoint keeps at most one save in flight).

        ``keep_base``: the sharded tensors go into buffers other than the base's (incremental
        saves; see :meth:`mark_base`). ``as_delta``: the snapshot carries the base to diff
        against (only if :attr:`has_base` and the buffers were not reallocated).
        """
        signature = _signature(state)
        leaves = list(_leaves(state))
        # (the parts, not the leaves: a ShardedTensor reports "cpu" whatever its shards' device)
        cuda = any(part.is_cuda for leaf in leaves for part in _parts(leaf))
        if self._buffers is None or signature != self._signature:
            if self._tables_fit(leaves, signature) and cuda == self._pinned:
                self._reallocate_changed(leaves, signature)
            else:
                self._allocate(leaves, signature, cuda)
        assert self._buffers is not None
        if keep_base:
            for i in self._sharded:
                if self._base.get(i) is self._buffers[i]:
                    spare = self._spare.pop(i, None)
                    self._buffers[i] = spare if spare is not None else self._buffer_like(self._base[i])
        previous = None
        if as_delta and self.has_base:
            previous = {id(self._buffers[i]): self._base[i] for i in self._sharded}
        plan = _Plan(self._buffers, late_storages or set())
        staged = plan.pair(state, "")
        for src, dst in plan.now:
            dst.copy_(src, non_blocking=cuda)  # CUDA: on the compute stream, before any later mutation
        boundary = None
        if cuda:
            boundary = torch.cuda.Event()
            boundary.record(torch.cuda.current_stream())
        return Snapshot(staged, plan.late, boundary, previous, {i: self._buffers[i] for i in self._sharded},
                        self._generation)

    def mark_base(self, snapshot: Snapshot) -> None:
        """``snapshot`` was committed (on every rank): its sharded buffers are the base of the next delta.

        Writer thread; the training thread does not stage while a save is in flight.
        """
        if snapshot.generation != self._generation:
            return  # the buffers were reallocated since (the state's shapes changed)
        for i, buffer in snapshot.sharded_buffers.items():
            old = self._base.get(i)
            if old is not None and old is not buffer:
                self._spare[i] = old
            self._base[i] = buffer
            if buffer is self._buffers[i] and i not in self._spare:
                # The next save must stage elsewhere: allocate its buffer here and fault its pages in, in the
                # writer thread, not while the training thread waits for that save's copy (the first delta
                # blocked training 1.5 s on it, for 0.8 GiB a rank; on CUDA, pinning takes longer still).
                spare = self._spare[i] = self._buffer_like(buffer)
                for part in _parts(spare):
                    part.zero_()
        self.nbytes = self._held_nbytes()

    def _held_nbytes(self) -> int:
        """The buffers, the spares and the base buffers that are neither (each counted once)."""
        assert self._buffers is not None
        return state_nbytes(self._buffers) + state_nbytes(list(self._spare.values())) + state_nbytes(
            [b for i, b in self._base.items() if b is not self._buffers[i]])

    def _buffer_like(self, buffer: Any) -> Any:
        """A second buffer of the same layout (the new snapshot's, while the base keeps the old one)."""
        shared = self._shared and shared_memory_fits(state_nbytes([buffer]))  # /dev/shm may hold one set, not two
        if _wraps_shards(buffer):
            made = _shards_buffer(buffer, self._pinned, shared)
        else:
            made = _create_cpu_state_dict({0: buffer}, pin_memory=self._pinned, share_memory=shared)[0]
        self.nbytes += state_nbytes([made])
        return made

    def _allocate(self, leaves: list[Any], signature: list[tuple[Any, ...]], pin_memory: bool) -> None:
        """One buffer per tensor leaf, in order (only when the tensors' shapes, dtypes or devices change)."""
        self._buffers = None  # free the old buffers before allocating new ones
        self._base, self._spare = {}, {}
        self._generation += 1
        self._sharded = [i for i, leaf in enumerate(leaves) if is_sharded(leaf)]
        self._pinned = pin_memory
        # On CUDA: shared + pinned gives exact-size page-locked buffers (cudaHostRegister); pinned
        # alone would go through the caching host allocator, which rounds sizes up and keeps freed
        # blocks, so the reported size would be wrong and release() would free nothing. Shared
        # memory lives in /dev/shm, which containers often cap (64 MiB by default): where the
        # buffers do not fit there, pinned alone it is, with a warning.
        shared = self._shared = pin_memory and shared_memory_fits(state_nbytes(leaves))
        created = _create_cpu_state_dict({i: leaf for i, leaf in enumerate(leaves) if not _wraps_shards(leaf)},
                                         pin_memory=pin_memory, share_memory=shared)
        self._buffers = [_shards_buffer(leaf, pin_memory, shared) if _wraps_shards(leaf) else created[i]
                         for i, leaf in enumerate(leaves)]
        self._signature = signature
        self.nbytes = state_nbytes(self._buffers)

    def _reallocate_changed(self, leaves: list[Any], signature: list[tuple[Any, ...]]) -> None:
        """New buffers only for the leaves whose shape changed or that are new (never the tables: see ``_tables_fit``);
        the base stays, so the next save may still be a delta."""
        assert self._buffers is not None
        old, old_signature = self._buffers, self._signature
        keep = {i: old[i] for i in range(min(len(old), len(signature))) if signature[i] == old_signature[i]}
        created = _create_cpu_state_dict({i: leaf for i, leaf in enumerate(leaves) if i not in keep},
                                         pin_memory=self._pinned, share_memory=False)
        self._buffers = [keep[i] if i in keep else created[i] for i in range(len(leaves))]
        self._signature = signature
        self.nbytes = self._held_nbytes()

    def release(self) -> None:
        self._buffers = None
        self._base, self._spare = {}, {}
        self._generation += 1  # a write still in flight (a crash's timed-out wait) must not mark a base afterwards
        self.nbytes = 0

