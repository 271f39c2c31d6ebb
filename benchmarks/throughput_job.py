"""One throughput measurement (2 gloo ranks; ``--device cuda``: NCCL, one rank per GPU): ETTStrategy or a TorchRec loop.

All arms use the example's DLRM, data (RandomRecDataset, seed = rank, through a DataLoader),
table-wise sharding, row-wise Adagrad fused into backward for the tables and Adagrad for the dense part:

* ``lightning``: ETTStrategy under ``Trainer.fit`` (its default: the sparse input distribution
  pipelined), with what users keep: the example's ``training_step`` (``self.log`` of the loss) and
  ETTMonitor;
* ``lightning_plain``: the same with ``ETTStrategy(pipeline=False)``;
* ``dmp``: the plain loop over a DistributedModelParallel (``next(batch)``, forward, backward, step);
* ``pipeline``: TorchRec's ``TrainPipelineSparseDist`` over the same DMP (``DLRMTrain`` computes the
  loss), the loop TorchRec users run: it starts the next batch's input distribution while the
  current batch trains;

Rank 0 writes the time per step to OUT: the total time over the steps after the warm-up divided by
their number (so periodic costs count), and the median step for reference. With ``--phases`` it adds
where that time went (:class:`PhaseClock`); ``--no-log`` and ``--no-monitor`` (Lightning arms) drop the
``self.log`` call and ETTMonitor, to size what each costs (``throughput_phases.py``). ``--gc-log`` adds each
rank-0 collection by Python's cyclic garbage collector during the timed steps (generation, step, ms), and
``--no-gc-freeze`` runs ETTStrategy with ``gc_freeze=False`` (``throughput_gc.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import ClassVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.dlrm_example import DLRMModule, RandomCriteoDataModule

LR = 0.05


class GcLog:
    """Python's garbage collections (``gc.callbacks``): generation, start (``perf_counter``) and milliseconds each."""

    def __init__(self, on: bool) -> None:
        self.collections: list[tuple[int, float, float]] = []
        self._start = 0.0
        if on:
            import gc

            gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.collections.append((info["generation"], self._start, 1000 * (time.perf_counter() - self._start)))

    def during(self, stamps: list[float], warmup: int) -> list[tuple[int, int, float]]:
        """Collections within the timed steps: (generation, the step it fell in, ms)."""
        import bisect

        timed = stamps[warmup:]
        return [(gen, bisect.bisect(stamps, start), ms) for gen, start, ms in self.collections
                if timed and timed[0] <= start <= timed[-1]]


def step_times(stamps: list[float], warmup: int) -> dict[str, float]:
    """Total time over the steps after ``warmup`` / their number, and the median step."""
    timed = stamps[warmup:]
    return {"step_s": (timed[-1] - timed[0]) / (len(timed) - 1),
            "median_step_s": statistics.median(b - a for a, b in itertools.pairwise(timed))}


class Profiler:
    """cProfile of rank 0's steady-state steps (``--profile``), written as a pstats file next to OUT."""

    def __init__(self, out: Path | None) -> None:
        import cProfile

        self.out = out
        self.profile = cProfile.Profile() if out is not None else None

    def start(self) -> None:
        if self.profile is not None:
            self.profile.enable()

    def stop(self) -> None:
        if self.profile is not None and self.out is not None:
            self.profile.disable()
            self.profile.dump_stats(str(self.out))


class PhaseClock:
    """Wall time per step in each phase of a loop, from ``perf_counter`` around the functions the loop calls.

    cProfile (``--profile``) put this loop's Python shares at ~1.9x these and fbgemm's lookup at 1.19 ms
    a step against ~0.75 ms timed directly, so the per-phase split is taken this way: a wrapper costs
    ~1 us a call, ~15 calls a step.
    Phases are disjoint; ``other`` is the step time left over (the loop's own code and whatever no phase
    covers: the loss, a strategy's per-step wrappers). Counted over the
    same steps as the step time (after the warm-up stamp, up to the last).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.armed = False

    def wrap(self, owner: object, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed(*args: object, **kwargs: object) -> object:
            if not self.armed:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)

    def common(self) -> None:
        """The phases both loops have: the model's forward (with its input and output all-to-all waits),
        backward, the dense optimizer's update and zero_grad."""
        import torch.optim.adagrad as adagrad_module  # (torch.optim does not expose the submodule as an attribute)
        from torchrec.models.dlrm import DLRM

        self.wrap(DLRM, "forward", "forward")
        self.wrap(torch.autograd, "backward", "backward")
        self.wrap(adagrad_module, "adagrad", "optimizer update")
        self.wrap(torch.optim.Adagrad, "zero_grad", "zero_grad")

    def lightning(self) -> None:
        from lightning.pytorch.core.module import LightningModule
        from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
        from lightning.pytorch.trainer import call

        from lightning_ett.strategies.input_pipeline import SparseInputPipeline

        self.common()
        self.wrap(_PrefetchDataFetcher, "__next__", "fetch")
        self.wrap(SparseInputPipeline, "before_step", "input dist: next batch in, splits started")
        self.wrap(SparseInputPipeline, "before_backward", "input dist: splits in, ids started")
        self.wrap(LightningModule, "log", "self.log")
        self.wrap(call, "_call_callback_hooks", "callbacks (ETTMonitor, the step clock)")

    def pipeline(self) -> None:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        self.common()
        self.wrap(TrainPipelineSparseDist, "enqueue_batch", "fetch")
        self.wrap(TrainPipelineSparseDist, "start_sparse_data_dist", "input dist: next batch in, splits started")
        self.wrap(TrainPipelineSparseDist, "wait_sparse_data_dist", "input dist: splits in, ids started")

    def per_step(self, steps: int) -> dict[str, float]:
        return {phase: seconds / steps for phase, seconds in self.seconds.items()}


def lightning_run(steps: int, warmup: int, out: Path, profile: Path | None = None, pipeline: bool = True,
                  device: str = "cpu", ranks: int = 2, phases: bool = False, log: bool = True,
                  monitor: bool = True, gc_log: bool = False, gc_freeze: bool = True) -> None:
    import tempfile

    from lightning.pytorch import Callback, Trainer

    from lightning_ett import ETTMonitor, ETTStrategy

    profiler = Profiler(profile)
    clock = PhaseClock()
    if phases:
        clock.lightning()
    collections = GcLog(gc_log)

    class StepClock(Callback):
        stamps: ClassVar[list[float]] = []

        def on_train_batch_end(self, trainer, *args: object) -> None:  # type: ignore[no-untyped-def]
            self.stamps.append(time.perf_counter())
            clock.armed = warmup < len(self.stamps) < steps
            if trainer.global_rank == 0 and len(self.stamps) == warmup:
                profiler.start()

        def on_train_end(self, trainer, *args: object) -> None:  # type: ignore[no-untyped-def]
            if trainer.global_rank == 0:
                profiler.stop()

    class Unlogged(DLRMModule):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return self.loss(self(batch), batch.labels.float())  # the same step as DLRMModule's, without self.log

    step_clock = StepClock()
    strategy = ETTStrategy(sharding_type="table_wise", fused_optimizer="row_wise_adagrad", fused_optimizer_kwargs={"lr": LR},
                           pipeline=pipeline, gc_freeze=gc_freeze)
    with tempfile.TemporaryDirectory() as run_dir:
        callbacks = [step_clock] + ([ETTMonitor(run_dir=run_dir, report_on_end=False)] if monitor else [])
        trainer = Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=ranks, strategy=strategy,
                          max_steps=steps, logger=False,
                          callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, limit_val_batches=0)
        trainer.fit((DLRMModule if log else Unlogged)(learning_rate=LR), RandomCriteoDataModule(batch_size=512))
    if trainer.global_rank == 0:
        pipeline = strategy.input_pipeline
        out.write_text(json.dumps({**step_times(step_clock.stamps, warmup),
                                   "pipelined_calls": pipeline.pipelined_calls if pipeline is not None else 0,
                                   **({"gc": collections.during(step_clock.stamps, warmup)} if gc_log else {}),
                                   **({"phases": clock.per_step(steps - warmup - 1)} if phases else {})}))


def dmp_worker(rank: int, steps: int, warmup: int, out: Path, port: int, loop: str, profile: Path | None,
               device_type: str = "cpu", ranks: int = 2, phases: bool = False, gc_log: bool = False) -> None:
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from lightning_ett.strategies.plan_cache import embedding_tables
    from lightning_ett.strategies.sharders import default_sharders

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(ranks))
    torch.set_num_threads(max((os.cpu_count() or 2) // ranks, 1))  # as torchrun and Lightning do: no oversubscription
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=ranks)
    torch.manual_seed(0)
    model = DLRMModule(learning_rate=LR).model
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": LR})
    if loop != "dmp":
        from torchrec.models.dlrm import DLRMTrain

        model = DLRMTrain(model)  # forward(batch) -> (loss, outputs), as TrainPipelineSparseDist expects
    constraints = {t: ParameterConstraints(sharding_types=["table_wise"]) for t in embedding_tables(model)}
    topology = Topology(world_size=ranks, compute_device=device_type, local_world_size=ranks)
    plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).plan(model, default_sharders(device_type))
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=default_sharders(device_type))
    dense = torch.optim.Adagrad([p for p in dmp.parameters() if not hasattr(p, "_in_backward_optimizers")], lr=LR)
    # Through a DataLoader, as the Lightning arm and any real training loop read data.
    data = iter(torch.utils.data.DataLoader(RandomCriteoDataModule(batch_size=512)._dataset(steps + 2, rank), batch_size=None))
    stamps: list[float] = []
    collections = GcLog(gc_log)
    profiler = Profiler(profile if rank == 0 else None)
    clock = PhaseClock()
    if phases and loop != "dmp":
        clock.pipeline()
    elif phases:
        clock.common()

    def stamp() -> None:
        stamps.append(time.perf_counter())
        clock.armed = warmup < len(stamps) < steps
        if len(stamps) == warmup:
            profiler.start()

    if loop != "dmp":
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        pipeline = TrainPipelineSparseDist(dmp, dense, device, execute_all_batches=True)
        for _ in range(steps):
            pipeline.progress(data)  # zero_grad, forward, backward, step; the next batch's input_dist overlapped
            stamp()
        with contextlib.suppress(StopIteration):  # drain: no rank leaves with the prefetched batch's all-to-all in flight
            while True:
                pipeline.progress(data)
    else:
        for _ in range(steps):
            batch = next(data).to(device)  # (on CPU: the same tensors)
            logits = dmp(batch.dense_features, batch.sparse_features).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
            dense.zero_grad()
            loss.backward()
            dense.step()
            stamp()
    profiler.stop()
    if rank == 0:
        out.write_text(json.dumps({**step_times(stamps, warmup),
                                   **({"gc": collections.during(stamps, warmup)} if gc_log else {}),
                                   **({"phases": clock.per_step(steps - warmup - 1)} if phases else {})}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["lightning", "lightning_plain", "dmp", "pipeline"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one rank per GPU")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--profile", default=None, help="rank 0 writes a cProfile of the steps after the warm-up here")
    p.add_argument("--phases", action="store_true", help="rank 0 adds the time per step in each phase to OUT")
    p.add_argument("--no-log", action="store_true", help="Lightning arms: training_step without self.log")
    p.add_argument("--no-monitor", action="store_true", help="Lightning arms: without ETTMonitor")
    p.add_argument("--gc-log", action="store_true", help="rank 0 adds its garbage collections during the timed steps")
    p.add_argument("--no-gc-freeze", action="store_true", help="Lightning arms: ETTStrategy(gc_freeze=False)")
    args = p.parse_args()
    if args.mode.startswith("lightning"):
        lightning_run(args.steps, args.warmup, Path(args.out), Path(args.profile) if args.profile else None,
                      pipeline=args.mode == "lightning", device=args.device, ranks=args.ranks, phases=args.phases,
                      log=not args.no_log, monitor=not args.no_monitor, gc_log=args.gc_log,
                      gc_freeze=not args.no_gc_freeze)
    else:
        import torch.multiprocessing as mp
        from lightning.fabric.plugins.environments.lightning import find_free_network_port

        profile = Path(args.profile) if args.profile else None
        mp.spawn(dmp_worker, args=(args.steps, args.warmup, Path(args.out), find_free_network_port(), args.mode,
                                   profile, args.device, args.ranks, args.phases, args.gc_log), nprocs=args.ranks)


if __name__ == "__main__":
    main()
