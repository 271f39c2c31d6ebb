"""One rank of benchmarks/sparse_2d.py: the example DLRM, 1D and 2D arms, all-to-all bytes counted as they are sent.

Runs under Lightning's own launcher (``--devices`` processes, one process group for every
fit). ``torch.distributed.all_to_all_single`` — what TorchRec's input (ids) and output
(pooled embeddings, and their gradients in backward) distributions call in eager mode — is
wrapped in this process only, to count the bytes this rank sends to *other* ranks and the
size of the group each call spans. Per arm: those counts per step (after a warm-up), step
times, the replica sync's payload and time, and synchronous ``trainer.save_checkpoint``
times with each rank's written bytes (2D: also with the table rows written by DCP's own dedup of
whole shards, and by one sharding group alone, for comparison). Writes OUT/rank<r>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from examples.dlrm_example import DLRMModule, RandomCriteoDataModule
from lightning_ett import ETTStrategy
from lightning_ett.checkpoint.staging import state_nbytes
from lightning_ett.patching import Patches
from lightning_ett.strategies import ett as ett_module

_COUNT: dict[str, Any] = {"on": False, "phase": "forward"}
_BYTES: dict[tuple[str, str, int], int] = defaultdict(int)  # (phase, kind, group size) -> bytes sent to peers
_CALLS: dict[tuple[str, str, int], int] = defaultdict(int)
_original_all_to_all_single = dist.all_to_all_single


def _counting_all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                                input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
    if _COUNT["on"]:
        size, me = dist.get_world_size(group), dist.get_rank(group)
        rows = input.shape[0] if input.dim() else 1
        row_bytes = (input.numel() // max(rows, 1)) * input.element_size()
        splits = list(input_split_sizes) if input_split_sizes else [rows // size] * size
        sent = sum(n for peer, n in enumerate(splits) if peer != me) * row_bytes
        kind = "embeddings" if input.is_floating_point() else ("splits" if input_split_sizes is None else "ids")
        key = (_COUNT["phase"], kind, size)
        _BYTES[key] += sent
        _CALLS[key] += 1
    return _original_all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


dist.all_to_all_single = _counting_all_to_all_single  # (this benchmark's processes only)


LOOPBACK_TX = Path("/sys/class/net/lo/statistics/tx_bytes")


def loopback_tx_bytes() -> int | None:
    """Bytes every process on this host has sent over loopback (IP packets, headers included)."""
    try:
        return int(LOOPBACK_TX.read_text())
    except (OSError, ValueError):
        return None


class Measure(Callback):
    """Counts from the ``warmup``-th step on; times every step, and the whole window (syncs and data included).

    The loopback counter is read at the window's two ends, independently of the wrapper: all
    ranks' traffic (all-to-alls, the replica sync, the dense all-reduce, TCP/IP headers).
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.step_s: list[float] = []
        self._start = 0.0
        self.window: list[float] = []  # [start of the first counted step, end of the last]
        self.loopback: list[int | None] = []

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        _COUNT["on"], _COUNT["phase"] = trainer.global_step >= self.warmup, "forward"
        if trainer.global_step == self.warmup:
            self.loopback = [loopback_tx_bytes()]
        self._start = time.perf_counter()
        if trainer.global_step == self.warmup:
            self.window = [self._start]

    def on_before_backward(self, *args: Any) -> None:
        _COUNT["phase"] = "backward"

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        end = time.perf_counter()
        if trainer.global_step > self.warmup:
            self.step_s.append(end - self._start)
        if _COUNT["on"]:
            self.window[1:] = [end]
            self.loopback[1:] = [loopback_tx_bytes()]
        _COUNT["on"] = False


def written_bytes(path: Path) -> dict[str, int]:
    """Bytes of table data (weights and row-wise state) each rank's DCP file holds."""
    per_file: dict[str, int] = defaultdict(int)
    for index, info in dcp.FileSystemReader(str(path)).read_metadata().storage_data.items():
        if "embedding_bags" in index.fqn:
            per_file[info.relative_path] += info.length
    return dict(per_file)


#: Who writes a 2D checkpoint's table rows: ETTStrategy's split of every shard's rows over its replicas
#: ("spread"); DCP's own dedup of whole shards, each to the replica with the least planned bytes so far
#: ("whole shards"); the lowest rank of each replica group, i.e. one sharding group writes it all ("one group").
WRITERS = ("spread", "whole shards", "one group")
ONE_D_WRITERS = "each rank its shards"


@contextmanager
def writers_patched(writers: str) -> Iterator[None]:
    patches = Patches()
    if writers != "spread":
        patches.setattr(ett_module, "spread_over_replicas", lambda state, groups: state)
    if writers != "spread":  # (dcp_io asks for the lowest rank, so that rank 0's buffers are saved: set either way)
        original = DefaultSavePlanner.__init__
        lowest = writers == "one group"

        def dedup_planner(self: DefaultSavePlanner, *a: Any, **kw: Any) -> None:
            original(self, *a, **kw)
            self.dedup_save_to_lowest_rank = lowest

        patches.setattr(DefaultSavePlanner, "__init__", dedup_planner)
    try:
        yield
    finally:
        patches.undo()


def run_arm(arm: dict[str, Any], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    seed_everything(0, workers=False, verbose=False)
    _BYTES.clear()
    _CALLS.clear()
    sharding = arm.get("sharding", "table_wise")
    constraints = None
    if sharding == "column_wise":  # every table in DIM/4 column shards of 4 columns (TorchRec's default is 128)
        from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
        from torchrec.distributed.planner import ParameterConstraints

        constraints = {f"t_{n}": ParameterConstraints(sharding_types=["column_wise"], min_partition=4)
                       for n in DEFAULT_CAT_NAMES}
    strategy = ETTStrategy(sharding_type=sharding, constraints=constraints, sharding_group_size=arm["k"],
                           replica_sync_every_n_steps=arm["interval"], fused_optimizer="row_wise_adagrad",
                           fused_optimizer_kwargs={"lr": 0.05})
    measure = Measure(args.warmup)
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps, logger=False,
                      callbacks=[measure], enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      num_sanity_val_steps=0, enable_checkpointing=False)
    data = RandomCriteoDataModule(batch_size=args.batch, num_embeddings=args.rows, num_train_batches=args.steps + 10)
    model = DLRMModule(num_embeddings=args.rows, embedding_dim=args.dim, dense_arch_layer_sizes=[128, args.dim],
                       over_arch_layer_sizes=[128, 64, 1])
    trainer.fit(model, datamodule=data)
    counted_steps = args.steps - args.warmup
    window_s = measure.window[1] - measure.window[0]
    lo = measure.loopback
    saves: dict[str, list[float]] = {}
    written: dict[str, dict[str, int]] = {}
    for writers in (WRITERS if arm["k"] else [ONE_D_WRITERS]) if args.saves else []:
        with writers_patched(writers):
            saves[writers] = []
            for i in range(args.saves):
                path = out / f"ckpt-{arm['name']}-{writers}-{i}"
                dist.barrier()
                start = time.perf_counter()
                trainer.save_checkpoint(path)
                took = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the save ends when its slowest rank has written
                saves[writers].append(float(took))
        written[writers] = written_bytes(out / f"ckpt-{arm['name']}-{writers}-0")
    tables = {name: value for name, value in trainer.strategy.model.state_dict().items() if "embedding_bags" in name}
    fused = trainer.strategy.fused_optimizer_instance
    sync = strategy.replica_sync
    return {
        "arm": arm, "rank": trainer.global_rank,
        "a2a_bytes_per_step": {f"{ph}/{kind}/{size}": b / counted_steps for (ph, kind, size), b in _BYTES.items()},
        "a2a_calls_per_step": {f"{ph}/{kind}/{size}": c / counted_steps for (ph, kind, size), c in _CALLS.items()},
        "step_s_median": statistics.median(measure.step_s), "steps_timed": len(measure.step_s),
        "step_s_mean": window_s / counted_steps,  # the whole window over its steps: syncs and data loading included
        "loopback_bytes_per_step": (lo[1] - lo[0]) / counted_steps if None not in lo and len(lo) == 2 else None,
        "dense_bytes": sum(v.numel() * v.element_size() for k, v in trainer.strategy.model.state_dict().items()
                           if "embedding_bags" not in k and isinstance(v, torch.Tensor)),
        "table_shards": sum(len(ps.sharding_spec.shards) if ps.sharding_spec is not None else 1  # the plan's, per group
                            for module in strategy.plan.plan.values() for ps in module.values()),
        "sync_payload_bytes": sync.nbytes if sync is not None else 0,
        "sync_s_per_sync": sync.seconds / sync.syncs if sync is not None and sync.syncs else 0.0,
        "syncs": sync.syncs if sync is not None else 0,
        "save_s": saves, "written_table_bytes": written,
        "embedding_memory_bytes": state_nbytes(tables) + (state_nbytes(fused.state_dict()["state"]) if fused else 0),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--arms", required=True, help='JSON list of {"name", "k", "interval"}, run in this order')
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--saves", type=int, default=3)
    args = p.parse_args()
    results = [run_arm(arm, args, args.out) for arm in json.loads(args.arms)]
    (args.out / f"rank{results[0]['rank']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
