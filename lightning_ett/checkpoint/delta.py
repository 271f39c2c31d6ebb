"""Row deltas of sharded tables: which rows changed since the last save, written and applied in global coordinates.

An incremental save writes, for every sharded tensor (embedding tables and their fused
optimizer states: TorchRec's ShardedTensors in 1D, DTensors over local shards in 2D), only the
rows of each local shard that differ from the previous save, as *records*: the tensor's key
path in the checkpoint state, the shard's global offsets, the global row numbers and the rows'
values. Global coordinates make a delta independent of the layout that wrote it: any world
size or sharding applies it to whatever shards it holds (:func:`apply`), and a whole-tensor
reader (the publisher) applies it to the gathered table (:func:`apply_whole`).

Why rows are found by comparing against the previous save's staged copy rather than with
TorchRec's ``ModelDeltaTracker`` (``DMP(model_tracker_config=...)``): the tracker records ids
as its lookups saw them (after input distribution, in each lookup's own id space, keyed by
feature), so mapping them to state-dict shards differs by sharding type; it sees only rows
that a lookup touched, not rows changed otherwise — 2D's replica averaging, a user's in-place
edit, a row whose update was exactly zero is harmless but a missed one is a silently wrong
resume. A byte-wise comparison is exact for every sharding type, optimizer and dtype by
construction. Its cost is one pass over the staged tables in the writer thread (chunked, so
the temporary masks stay small) and a second set of staging buffers for the sharded tensors
(the previous save's rows; :class:`lightning_ett.checkpoint.staging.Stager`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from lightning_ett.durable.manifest import ChecksummingWriter

#: Each rank's rows of one incremental save, in the checkpoint directory.
DELTA_FILE = "delta-rank{rank:05d}.pt"
DELTA_GLOB = "delta-rank*.pt"
_FORMAT = 1
_CHUNK_BYTES = 64 << 20  # rows compared per pass: bounds the temporary mask memory
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)  # integer words rows are compared and copied in, widest first
_WORD_OF_SIZE = {word.itemsize: word for word in _WORDS}
INDEX_FILE = "delta-index.json"


KeyPath = tuple[str, ...]


@dataclass
class RowRecord:
    """Changed rows of one shard of one sharded tensor: ``values[i]`` is global row ``rows[i]``.

    ``rows`` is ``None`` for a whole shard (``values`` is the shard, from global row ``offsets[0]``):
    written so when most rows changed, which is smaller than rows plus their numbers and gathers nothing.
    """

    key: KeyPath
    offsets: tuple[int, ...]  # the shard's global offsets (row, column, ...)
    rows: torch.Tensor | None  # int64, global row numbers; None: every row of the shard
    values: torch.Tensor  # [len(rows), *shard.shape[1:]]

    @property
    def global_rows(self) -> torch.Tensor:
        if self.rows is not None:
            return self.rows
        return torch.arange(self.offsets[0], self.offsets[0] + self.values.shape[0])

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + (self.rows.numel() * 8 if self.rows is not None else 0)

    def to_dict(self) -> dict[str, Any]:
        return {"key": list(self.key), "offsets": list(self.offsets), "rows": self.rows, "values": self.values}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RowRecord:
        return cls(tuple(d["key"]), tuple(d["offsets"]), d["rows"], d["values"])


def is_sharded(leaf: Any) -> bool:
    """A tensor whose rows are spread over ranks: TorchRec's 1D ShardedTensor, or 2D's DTensor over local shards."""
    if isinstance(leaf, ShardedTensor):
        return True
    local = getattr(leaf, "_local_tensor", None) if isinstance(leaf, DTensor) else None
    return hasattr(local, "local_shards") and hasattr(local, "local_offsets")


def shards_with_offsets(leaf: Any) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """The local shards of a sharded leaf with their global offsets."""
    if isinstance(leaf, ShardedTensor):
        return [(s.tensor, tuple(s.metadata.shard_offsets)) for s in leaf.local_shards()]
    local = leaf._local_tensor
    shards = local.local_shards()
    if not shards:  # 2D, a table this rank holds no shard of: TorchRec's empty wrapper still lists one offset
        return []
    return [(t, tuple(o)) for t, o in zip(shards, local.local_offsets(), strict=True)]


def sharded_leaves(state: Any, prefix: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """(key path, leaf) of every sharded tensor in a nested dict state."""
    if is_sharded(state):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from sharded_leaves(value, (*prefix, str(key)))


def subset(state: dict[str, Any], keep: Callable[[KeyPath, Any], bool], prefix: KeyPath = ()) -> dict[str, Any]:
    """The leaves of a nested dict state (same nesting, same objects) for which ``keep(key path, leaf)``; empty
    dicts dropped. A leaf is anything but a dict: a tensor, a list of parameter groups, a number."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        path = (*prefix, str(key))
        if isinstance(value, dict) and not is_sharded(value):
            if inner := subset(value, keep, path):
                out[key] = inner
        elif keep(path, value):
            out[key] = value
    return out


def without_sharded(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without its sharded tensors: what an incremental save writes in full (the dense state)."""
    return subset(state, lambda _, leaf: not is_sharded(leaf))


def changed_rows(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Indices of the rows of ``current`` whose bytes differ from ``previous`` (CPU, contiguous, same shape).

    Bytes, not values: NaN equals NaN and -0.0 differs from 0.0, so applying the rows reproduces
    ``current`` bit for bit.
    """
    if current.shape != previous.shape or current.dtype != previous.dtype:
        raise ValueError(f"cannot diff {tuple(current.shape)}/{current.dtype} against "
                         f"{tuple(previous.shape)}/{previous.dtype}")
    n = current.shape[0] if current.dim() else 1
    if n == 0 or current.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    a, b = as_words(current.reshape(n, -1), previous.reshape(n, -1))
    step = max(1, _CHUNK_BYTES // max(1, a.shape[1] * a.element_size()))
    found = [torch.nonzero((a[i:i + step] != b[i:i + step]).any(dim=1)).flatten() + i for i in range(0, n, step)]
    return torch.cat(found) if found else torch.zeros(0, dtype=torch.int64)


def as_words(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of same-width row tensors (``[rows, ...]``) as ``[rows, words]`` of the widest
    integer word that all of them allow: compared (:func:`changed_rows`) and copied (:func:`_paste`) as bits, so
    every dtype (float8 and float4 too, NaN payloads, -0.0) round-trips exactly, and in as few elements as the
    rows allow: a 64-float row is 32 words, not 64 (a copy of scattered rows costs per element as well as per byte).

    Views, never copies: a column slice of a table stays a view, so a paste into it writes the table. A word is
    chosen only where every row starts on a multiple of it in memory (CUDA faults on misaligned words); tensors
    whose rows cannot be viewed as bytes (a transposed or permuted layout) are viewed element by element, as
    integers of their own element size, in their own shapes.
    """
    try:
        as_bytes = [(t.unsqueeze(1) if t.dim() == 1 else t.view(t.shape[0], -1)).view(torch.uint8) for t in tensors]
    except RuntimeError:  # last stride not 1, or dimensions that do not fold into rows: element by element
        return tuple(t.view(_WORD_OF_SIZE[t.element_size()]) for t in tensors)
    for word in _WORDS:
        size = word.itemsize
        if all(b.shape[1] % size == 0 and b.storage_offset() % size == 0 and b.data_ptr() % size == 0
               and all(stride % size == 0 for stride in b.stride()[:-1]) for b in as_bytes):
            return tuple(b.view(word) for b in as_bytes)
    raise AssertionError("unreachable: every row is a whole number of bytes")


def diff(current: dict[str, Any], previous: dict[int, Any], since_full: RowsSinceFull | None = None
         ) -> tuple[list[RowRecord], int, int]:
    """The records of every sharded leaf of ``current`` against its previous copy (``previous[id(leaf)]``).

    Returns the records, the rows that changed and the rows compared; the changed rows are also marked in
    ``since_full``. Peak memory: the changed rows gathered, which whole-shard records bound to about the
    sharded state's size.
    """
    records: list[RowRecord] = []
    compared = changed = 0
    for key, leaf in sharded_leaves(current):
        before = previous[id(leaf)]
        for (now, offsets), (then, _) in zip(shards_with_offsets(leaf), shards_with_offsets(before), strict=True):
            rows = changed_rows(now, then)
            compared += _row_count(now)
            if since_full is not None:
                since_full.mark(key, offsets, now, rows)
            if rows.numel():
                changed += rows.numel()
                records.append(_record(key, offsets, now, rows))
    return records, changed, compared


def _record(key: KeyPath, offsets: tuple[int, ...], now: torch.Tensor, rows: torch.Tensor) -> RowRecord:
    """The rows ``rows`` (local, sorted) of the shard ``now``; the shard whole when that is smaller (no gather)."""
    if _gathered_nbytes(now, rows.numel()) >= _whole_nbytes(now):
        return RowRecord(key, offsets, None, now)
    return RowRecord(key, offsets, rows + offsets[0], now[rows])


def _record_nbytes(shard: torch.Tensor, rows: int) -> int:
    """What :func:`_record` of ``rows`` rows of ``shard`` holds (:attr:`RowRecord.nbytes`), without building it."""
    return min(_gathered_nbytes(shard, rows), _whole_nbytes(shard))


def _gathered_nbytes(shard: torch.Tensor, rows: int) -> int:
    """``rows`` rows gathered, with their numbers."""
    return rows * (_row_bytes(shard) + 8)


def _whole_nbytes(shard: torch.Tensor) -> int:
    return _row_count(shard) * _row_bytes(shard)


def _row_count(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() else 1


def _row_bytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size() if t.dim() else t.element_size()


class RowsSinceFull:
    """Each shard's rows changed since the chain's full save: what a rebase writes (``chain.Rebase``).

    Marked from every comparison (:func:`diff`), committed or not, and cleared only when a full save
    commits (:meth:`clear`): a superset of the rows that differ from the full save (a row changed back is
    written again, harmless), never a subset, which would be a silently wrong restore. So it answers
    only after a full save this process committed (:attr:`valid`), not for a chain it took over.
    """

    def __init__(self) -> None:
        self._masks: dict[tuple[KeyPath, tuple[int, ...]], torch.Tensor] = {}
        self.valid = False

    def clear(self) -> None:
        """A full save committed: nothing has changed since it."""
        self._masks, self.valid = {}, True

    def invalidate(self) -> None:
        """Not kept up (no rebase is asked for): only the next committed full save makes it answer again."""
        self._masks, self.valid = {}, False

    def mark(self, key: KeyPath, offsets: tuple[int, ...], shard: torch.Tensor, rows: torch.Tensor) -> None:
        n = _row_count(shard)
        mask = self._masks.get((key, offsets))
        if mask is None or mask.numel() != n:
            if mask is not None:
                self.valid = False  # another layout than the full save's: only a full save answers again
            mask = self._masks[(key, offsets)] = torch.zeros(n, dtype=torch.bool)
        mask[rows] = True

    def nbytes(self, current: dict[str, Any]) -> int:
        """What :meth:`records` of ``current`` would hold, without gathering them."""
        return sum(_record_nbytes(now, int(mask.sum())) for _, _, now, mask in self._marked(current))

    def records(self, current: dict[str, Any]) -> list[RowRecord]:
        """The rows of ``current`` changed since the full save (as :func:`diff` writes records)."""
        return [_record(key, offsets, now, torch.nonzero(mask).flatten())
                for key, offsets, now, mask in self._marked(current) if mask.any()]

    def _marked(self, current: dict[str, Any]) -> Iterator[tuple[KeyPath, tuple[int, ...], torch.Tensor, torch.Tensor]]:
        """(key path, offsets, shard, its mask) of every shard of ``current`` with marks."""
        for key, leaf in sharded_leaves(current):
            for now, offsets in shards_with_offsets(leaf):
                if (mask := self._masks.get((key, offsets))) is not None:
                    yield key, offsets, now, mask


def write(records: list[RowRecord], directory: Path, rank: int) -> dict[str, tuple[int, int]]:
    """This rank's records as one file (fsynced by the commit); returns its (size, CRC-32), summed as written."""
    path = directory / DELTA_FILE.format(rank=rank)
    with open(path, "wb") as raw:
        summing = ChecksummingWriter(raw)
        torch.save({"format": _FORMAT, "records": [r.to_dict() for r in records]}, summing)
    return {path.name: summing.checksum} if summing.checksum is not None else {}


def spans(records: list[RowRecord]) -> list[list[Any]]:
    """Where each record lies, for the checkpoint's index (:func:`write_index`):
    ``[key path, first row, end row, first column, end column]``
    (columns ``-1, -1`` for a 1-D tensor). A restore opens only the files whose records reach the shards it holds
    (:class:`Holdings`): with N ranks, one file per delta instead of N for a rank restoring its own layout."""
    out: list[list[Any]] = []
    for r in records:
        if r.rows is None:
            lo, hi = r.offsets[0], r.offsets[0] + r.values.shape[0]
        elif r.rows.numel():
            lo, hi = int(r.rows.min()), int(r.rows.max()) + 1
        else:
            continue
        columns = (r.offsets[1], r.offsets[1] + r.values.shape[1]) if r.values.dim() > 1 and len(r.offsets) > 1 \
            else (-1, -1)
        out.append([list(r.key), lo, hi, *columns])
    return out


class Holdings:
    """What a restore target holds, by key path, for :meth:`reaches`: built once per target, so that
    checking the index costs a dict lookup per span, however many ranks wrote the delta."""

    def __init__(self, target: dict[str, Any]) -> None:
        self.whole: set[KeyPath] = set()  # held unsharded (a table now data-parallel): every row lands
        self.shards: dict[KeyPath, list[tuple[int, int, int, int]]] = {}  # rows [lo, hi), columns [lo, hi) (-1: 1-D)
        for key, leaf in _leaves(target):
            if is_sharded(leaf):
                self.shards[key] = [
                    (o[0], o[0] + t.shape[0], *((o[1], o[1] + t.shape[1]) if t.dim() > 1 else (-1, -1)))
                    for t, o in shards_with_offsets(leaf) if t.dim() > 0]
            elif isinstance(leaf, torch.Tensor):
                self.whole.add(key)

    def reaches(self, span: list[Any]) -> bool:
        """Would a record at ``span`` (see :func:`spans`) write anything here, as :func:`apply` applies it?"""
        key, lo, hi, first, end = tuple(span[0]), *span[1:]
        if key in self.whole:
            return True
        return any(r0 < hi and lo < r1 and (first < 0 or c0 < 0 or (c0 < end and first < c1))
                   for r0, r1, c0, c1 in self.shards.get(key, ()))


def _leaves(state: Any, prefix: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """(key path, leaf) of every leaf of a nested dict state; a sharded tensor is a leaf."""
    if isinstance(state, dict) and not is_sharded(state):
        for key, value in state.items():
            yield from _leaves(value, (*prefix, str(key)))
    else:
        yield prefix, state


def write_index(index: dict[str, list[list[Any]]], directory: Path) -> dict[str, tuple[int, int]]:
    """Rank 0: every rank's file's spans (see :func:`spans`) as ``delta-index.json``, each key path stored once;
    returns its (size, CRC-32). A file of its own, not the manifest: retention and verification parse
    every kept manifest, and the index grows with ranks x tables."""
    keys: dict[tuple[str, ...], int] = {}
    files = {name: [[keys.setdefault(tuple(span[0]), len(keys)), *span[1:]] for span in where]
             for name, where in index.items()}
    path = directory / INDEX_FILE
    with open(path, "wb") as raw:
        summing = ChecksummingWriter(raw)
        summing.write(json.dumps({"format": _FORMAT, "keys": [list(k) for k in keys], "files": files},
                                 separators=(",", ":")).encode())
    return {path.name: summing.checksum} if summing.checksum is not None else {}


def read_index(directory: Path) -> dict[str, list[list[Any]]] | None:
    """The spans of every rank's file of one incremental save (``None``: no index: every file is read)."""
    try:
        saved = json.loads((directory / INDEX_FILE).read_text())
        if saved.get("format") != _FORMAT:
            return None
        keys = saved["keys"]
        return {name: [[keys[k], *rest] for k, *rest in where] for name, where in saved["files"].items()}
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None  # unreadable: every file is read


def read(directory: Path, index: dict[str, Any] | None = None, target: dict[str, Any] | None = None
         ) -> Iterator[RowRecord]:
    """Every rank's records of one incremental save (memory-mapped: only the rows applied are read).

    With the checkpoint's ``index`` (:func:`read_index`) and the ``target`` they will be applied to, a
    file whose records reach none of the target's shards is not opened (a file the index does not list
    always is).
    """
    holdings = Holdings(target) if index is not None and target is not None else None
    for path in sorted(directory.glob(DELTA_GLOB)):
        where = index.get(path.name) if holdings is not None and index is not None else None
        if isinstance(where, list) and holdings is not None and not any(holdings.reaches(span) for span in where):
            continue
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if saved.get("format") != _FORMAT:
            raise ValueError(f"{str(path)!r} is a delta of an unknown format {saved.get('format')!r}")
        for d in saved["records"]:
            yield RowRecord.from_dict(d)


def leaf_at(state: dict[str, Any], key: KeyPath) -> Any | None:
    node: Any = state
    for part in key:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _paste(target: torch.Tensor, target_offsets: tuple[int, ...], record: RowRecord) -> int:
    """Write the record's rows that fall inside ``target`` (a shard at ``target_offsets``); returns how many.

    The common case, a record from the same layout (every row inside, every column), is one
    ``index_copy_`` straight from the (memory-mapped) values: no mask, no gathered copy. A
    restore applies every delta of a chain this way, so its cost per row is what bounds the
    chain (see ``AsyncCheckpoint``'s chain policy).
    """
    values = record.values
    local = record.global_rows - target_offsets[0]
    if not local.numel():
        return 0
    if target.dim() > 1:  # columns: the overlap of the record's column range with the shard's
        lo = max(record.offsets[1], target_offsets[1])
        hi = min(record.offsets[1] + values.shape[1], target_offsets[1] + target.shape[1])
        if hi <= lo:
            return 0
        if (lo, hi) != (record.offsets[1], record.offsets[1] + values.shape[1]):
            values = values[:, lo - record.offsets[1]:hi - record.offsets[1]]
        if (lo, hi) != (target_offsets[1], target_offsets[1] + target.shape[1]):
            target = target[:, lo - target_offsets[1]:hi - target_offsets[1]]  # a view: written in place
    if int(local.min()) < 0 or int(local.max()) >= target.shape[0]:  # another layout: only the rows inside
        pick = torch.nonzero((local >= 0) & (local < target.shape[0])).flatten()
        if not pick.numel():
            return 0
        local, values = local[pick], values[pick]
    into, rows = as_words(target, values.to(target.device, target.dtype))
    into.index_copy_(0, local.to(target.device), rows)
    return int(local.numel())


def apply(records: Iterator[RowRecord], target: dict[str, Any]) -> int:
    """Apply ``records`` to the sharded leaves of ``target`` that this rank holds (any layout); returns rows written.

    A record for a tensor ``target`` does not hold (another world's extra state) is skipped;
    one for a tensor it holds unsharded (a table now data-parallel) is pasted into it whole.
    """
    written = 0
    for record in records:
        leaf = leaf_at(target, record.key)
        if leaf is None:
            continue
        if is_sharded(leaf):
            with torch.no_grad():
                for shard, offsets in shards_with_offsets(leaf):
                    written += _paste(shard, offsets, record)
        elif isinstance(leaf, torch.Tensor):
            written += apply_whole(record, leaf)
    return written


def apply_whole(record: RowRecord, whole: torch.Tensor) -> int:
    """Apply one record to a whole (gathered) tensor."""
    with torch.no_grad():
        return _paste(whole, (0,) * max(whole.dim(), 1), record)


def records_nbytes(records: list[RowRecord]) -> int:
    return sum(r.nbytes for r in records)
