"""Average the replicas of every sharded table (weights and row-wise AdaGrad state) over each replica group.

In 2D sparse parallelism each sharding group trains its own copy of the tables on its share
of the batch; every ``every_n_steps`` optimizer steps the copies are averaged, so the N/K
replicas of a shard hold the same values again. What is averaged is what TorchRec's
``DMPCollection.sync`` averages: each fbgemm table-batched kernel's weights and its optimizer
``sum`` (row-wise AdaGrad's per-row accumulator, AdaGrad's per-element one). The published
optimizer ("momentum-scaled row-wise AdaGrad") is in neither fbgemm nor TorchRec, and its
formula is not public; it is not reproduced here.

On CUDA this calls ``DMPCollection.sync`` (NCCL's ``AVG`` reduction, in place). On CPU, which
DMPCollection refuses, the same tensors are reduced here over gloo as a SUM followed by a
division by the replica count. Gloo's ``ReduceOp.AVG`` is not to be relied on: it arrived late
(pytorch/pytorch#149781, a sum and a division inside gloo's work object), one of its
collectives silently summed instead of averaging (pytorch/pytorch#162338), and it raises for
integer tensors. SUM is what every gloo release computes, bit-identically on every rank, so
the replicas come out bit-identical after the division. Tensors are reduced in buckets of at
most ``bucket_bytes`` (one flat copy each), not as one flat copy of every table, so the sync
needs bounded extra memory.

Replicas must also *start* equal: each rank initializes its own copy of its shards, so
:meth:`ReplicaSync.start_equal` broadcasts the first replica's values (averaging independent
initializations would shrink their variance).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torchrec.distributed.model_parallel import DistributedModelParallel, DMPCollection

#: The optimizer state TorchRec's 2D sync averages (``DMPCollection._cache_sync_tensors``).
SYNCED_OPTIMIZER_STATE = "sum"
BUCKET_BYTES = 32 * 2**20


def table_kernels(root: nn.Module) -> list[SplitTableBatchedEmbeddingBagsCodegen]:
    """fbgemm's table-batched kernels under ``root``, lookups included (TorchRec keeps some outside ``children()``)."""
    found: dict[int, SplitTableBatchedEmbeddingBagsCodegen] = {}

    def visit(module: nn.Module) -> None:
        if isinstance(module, SplitTableBatchedEmbeddingBagsCodegen):
            found.setdefault(id(module), module)
        for lookup in getattr(module, "_lookups", None) or []:
            if isinstance(lookup, nn.Module):
                visit(lookup)
        for child in module.children():
            visit(child)

    visit(root)
    return list(found.values())


def sync_tensors(root: nn.Module) -> list[torch.Tensor]:
    """Views of every table weight and synced optimizer state this rank holds, in a fixed order."""
    tensors: list[torch.Tensor] = []
    for kernel in table_kernels(root):
        tensors += [w for w in kernel.split_embedding_weights() if w.numel()]
        for state in kernel.get_optimizer_state():
            value = state.get(SYNCED_OPTIMIZER_STATE)
            if isinstance(value, torch.Tensor) and value.numel():
                tensors.append(value)
    return tensors


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        by_dtype[tensor.dtype].append(tensor)
    for same in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for tensor in same:
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(tensor)
            size += nbytes
        if bucket:
            yield bucket


class ReplicaSync:
    """Counts optimizer steps and averages the replicas every ``every_n_steps`` of them (collective on every rank)."""

    def __init__(self, model: DistributedModelParallel, replica_group: dist.ProcessGroup, num_replicas: int,
                 every_n_steps: int, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.model = model
        self.replica_group = replica_group
        self.num_replicas = num_replicas
        self.every_n_steps = every_n_steps
        self.bucket_bytes = bucket_bytes
        self._tensors = sync_tensors(model)
        self.dirty = False  # a training batch has moved the replicas apart since they were last averaged
        self.syncs = 0
        self.seconds = 0.0  # time spent averaging, summed over syncs

    @property
    def nbytes(self) -> int:
        """Bytes this rank contributes to one sync (its weights and optimizer state)."""
        return sum(t.numel() * t.element_size() for t in self._tensors)

    @torch.no_grad()
    def start_equal(self) -> None:
        """Give every replica the first replica's freshly initialized tables (once, after sharding)."""
        for tensor in self._tensors:
            dist.broadcast(tensor, group_src=0, group=self.replica_group)

    def mark_changed(self) -> None:
        """A training batch ran: its backward (every micro-batch, not every step) moved this replica's rows."""
        self.dirty = True

    def after_optimizer_step(self, completed_step: int) -> None:
        """Called after each optimizer step; ``completed_step`` is the global step it completes (1-based)."""
        if completed_step % self.every_n_steps == 0:
            self.sync()

    def sync(self) -> None:
        """Average now unless nothing changed since the last average.

        Collective: every rank must call it at the same point. "Changed" is counted in
        training batches, not global steps: with gradient accumulation the fused optimizer moves the
        replicas apart at every micro-batch, so a save between micro-batches must average too.
        """
        if not self.dirty:
            return
        start = time.perf_counter()
        if isinstance(self.model, DMPCollection):
            self.model.sync(include_optimizer_state=True)
        else:
            self._sum_then_divide()
        self.seconds += time.perf_counter() - start
        self.syncs += 1
        self.dirty = False

    @torch.no_grad()
    def _sum_then_divide(self) -> None:
        for bucket in _buckets(self._tensors, self.bucket_bytes):
            if len(bucket) == 1:
                (flat,) = bucket  # in place: the weights' own storage
            else:
                flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.replica_group)
            flat.div_(self.num_replicas)
            if len(bucket) > 1:
                for tensor, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    tensor.copy_(averaged)
