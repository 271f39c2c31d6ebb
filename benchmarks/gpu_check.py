"""GPU check (issue #15): NCCL start-up overlap, AsyncCheckpoint, CompileCache and DynamicShapes on one CUDA machine.

    python benchmarks/gpu_check.py [--out FILE] [--sections pg,checkpoint,dynamic_shapes,compile_cache]
    python benchmarks/gpu_check.py --device cpu --without-torchrec   # dry run of every code path on CPU

One command, well under 8 minutes on one GPU, on an image with Lightning but without TorchRec
and fbgemm (run from the repository root; ``lightning_ett`` is put on ``sys.path``, not
installed). Every measurement runs in a fresh child process (this file, ``--child``) with
its own time limit, its own empty inductor and Triton caches, and no TorchRec: a hang or a
crash costs one section, never the whole run. It prints one plain-text table, and writes its
figures as JSON to ``--out`` (default ``$OUT/gpu_check.json`` when ``$OUT`` is set).

* ``pg``: process-group creation as ETTStrategy does it (``strategies/process_group.py``,
  NCCL with eager init through ``device_id=``, plus gloo) alone, a dense model's
  initialisation alone, and both overlapped (ETTStrategy's ``BackgroundTask``): one rank per
  GPU, at most 2. ``lightning_ett.strategies``'s ``__init__`` imports TorchRec (through
  ``ett.py``), so ``process_group.py`` is loaded from its file, not as a submodule.
* ``checkpoint``: ``AsyncCheckpoint`` on a ~1 GB (parameters + Adam state) dense model on one
  GPU: staging buffers pinned, the device-to-host copy off the compute stream (a profile of
  one save, read from its Chrome trace), training-thread time blocked per save, step time with
  vs without saves, ETTMonitor's phase split, and the last checkpoint complete and resumed.
* ``dynamic_shapes``: recompiles of a compiled model over varying batch sizes, with and without
  ``DynamicShapes``.
* ``compile_cache``: time to the first step of a cold start, a warm restart and a start on a
  fresh host that has only CompileCache's bundle (the portable mega-cache, which must carry
  the Triton kernels: every start has an empty Triton cache directory).
* ``kernels_2d``: issue #32's refusal of ``fused_uvm_caching`` in 2D, and the reason for it on a GPU (only where
  TorchRec and fbgemm are installed; on the GPU image it says it did not run).
* ``pipeline``: issue #33's pipelined input distribution on the device (``benchmarks/throughput_job.py``
  on one rank per device, up to 2): steps/s of ETTStrategy, ``ETTStrategy(pipeline=False)`` and
  TorchRec's ``TrainPipelineSparseDist`` on the same DLRM, one run each (only where TorchRec and
  fbgemm are installed; on the GPU image it says it did not run).
* ``hang``: the hang watch's evidence on NCCL (issue #28). Two ranks, one per GPU (2+ GPUs): rank 1
  stops making collectives (a hang in Python) while rank 0 enqueues the next all-reduce and waits at
  a host sync. Read from outside, as the watch reads them: rank 0's CPU share while it waits (a CUDA
  wait spins), both ranks' flight recorders (served on request, ``_dump_nccl_trace``), the rank they
  name, and whether the rule that ignores a CUDA rank's CPU time while a collective of it is pending
  holds. NCCL cannot put two ranks on one GPU: on a single GPU one rank enqueues an all-reduce behind
  a 3 s GPU sleep instead, which checks the spin, the NCCL recorder dump and its pending state; the
  blame then runs on gloo.

Without CUDA it says so and exits 0 (what CPU CI runs). A section that raises, or whose checks
fail, is a FAILED row, and the exit code is 1; the other sections still run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ("pg", "checkpoint", "dynamic_shapes", "compile_cache", "hang", "kernels_2d", "pipeline")
BLOCK_ENV = "GPU_CHECK_BLOCK_MODULES"  # children set these to None in sys.modules (as if not installed)
ABSENT_ON_GPU_IMAGE = ("torchrec", "fbgemm_gpu")
DEADLINE_S = 450.0  # the whole run, children included (the brief: under 8 minutes)
SECTION_CAP_S = {"pg": 75.0, "checkpoint": 170.0, "dynamic_shapes": 140.0, "compile_cache": 170.0, "hang": 60.0,
                 "kernels_2d": 30.0, "pipeline": 150.0}
_DROP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")

# Sizes per device: the CUDA ones are the check; the CPU ones only walk the code paths.
SIZES = {
    "cuda": {"pg_width": 4096, "pg_layers": 8, "ckpt_width": 4096, "ckpt_layers": 5, "ckpt_batch": 2048,
             "compile_width": 1024, "compile_layers": 2, "compile_batch": 512, "fit_cap_s": 90.0, "base_steps": 60,
             "first_save_at": 20},
    "cpu": {"pg_width": 1024, "pg_layers": 4, "ckpt_width": 512, "ckpt_layers": 3, "ckpt_batch": 64,
            "compile_width": 128, "compile_layers": 2, "compile_batch": 64, "fit_cap_s": 60.0, "base_steps": 30,
            "first_save_at": 10},
}
VARYING_BATCHES = [512, 512, 300, 512, 177, 64, 1000, 77]


# ====================================================================== what the children import
def _load_file_module(name: str) -> Any:
    """``lightning_ett/strategies/<name>.py`` as a module, without running ``lightning_ett/strategies/__init__.py``
    (which imports ``ett.py``, hence TorchRec). Its own imports are plain ones."""
    import importlib.util

    qualified = f"lightning_ett.strategies.{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    alias = f"_gpu_check_strategies_{name}"
    if alias not in sys.modules:
        spec = importlib.util.spec_from_file_location(alias, REPO / "lightning_ett" / "strategies" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[alias] = module
        spec.loader.exec_module(module)
    return sys.modules[alias]


def import_strategy_pieces() -> SimpleNamespace:
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_ett.instrument.timeline import Phase

    try:  # where ETTStrategy's BackgroundTask lives now; it was strategies/overlap.py before
        from lightning_ett.instrument.background import BackgroundTask
    except ImportError:
        BackgroundTask = _load_file_module("overlap").BackgroundTask
    process_group = _load_file_module("process_group")
    return SimpleNamespace(LightningEnvironment=LightningEnvironment, init_process_group=process_group.init_process_group,
                           default_backend=process_group.default_backend, BackgroundTask=BackgroundTask,
                           PROCESS_GROUP_INIT=Phase.PROCESS_GROUP_INIT)


def import_callback_pieces() -> SimpleNamespace:
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.loggers import Logger

    from lightning_ett.callbacks.checkpoint import AsyncCheckpoint
    from lightning_ett.callbacks.compile_cache import CompileCache
    from lightning_ett.callbacks.dynamic_shapes import DynamicShapes
    from lightning_ett.callbacks.monitor import ETTMonitor
    from lightning_ett.checkpoint import layout
    from lightning_ett.compile.cache import compile_metrics
    from lightning_ett.instrument.compile_events import compile_tracker
    from lightning_ett.instrument.environment import process_start_time
    from lightning_ett.instrument.summary import summarize_run_dir

    return SimpleNamespace(Callback=Callback, LightningModule=LightningModule, Trainer=Trainer, Logger=Logger,
                           AsyncCheckpoint=AsyncCheckpoint, CompileCache=CompileCache, DynamicShapes=DynamicShapes,
                           ETTMonitor=ETTMonitor, layout=layout, compile_metrics=compile_metrics,
                           compile_tracker=compile_tracker, process_start_time=process_start_time,
                           summarize_run_dir=summarize_run_dir)


def import_pieces() -> SimpleNamespace:
    """Everything any child imports (the test runs this with TorchRec and fbgemm blocked)."""
    return SimpleNamespace(**vars(import_strategy_pieces()), **vars(import_callback_pieces()))


# ====================================================================== children
class Reporter:
    """A child's figures, rewritten to its result file at every put: a child killed later still reports them."""

    def __init__(self, path: Path) -> None:
        self.path, self.figures = path, {}

    def put(self, **figures: Any) -> None:
        self.figures.update(figures)
        self.write({"ok": None, "figures": self.figures})

    def write(self, payload: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, default=str))
        os.replace(tmp, self.path)


def _dense(width: int, layers: int) -> Any:
    import torch

    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, 1))


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def child_pg(p: dict[str, Any], out: Reporter) -> None:
    """One rank of one arm: ``pg`` (process group alone), ``model`` (model init alone) or ``both`` (overlapped)."""
    import datetime

    import torch
    import torch.distributed as dist

    s = import_strategy_pieces()
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = p["device"] == "cuda"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    backend = s.default_backend(device)
    out.put(rank=rank, world_size=world, backend=backend, arm=p["arm"])
    if cuda:  # Lightning selects the device before ETTStrategy's overlap: the context is not part of it
        t = time.perf_counter()
        torch.cuda.set_device(device)
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)
        out.put(cuda_context_s=time.perf_counter() - t, device_name=torch.cuda.get_device_name(device))
        try:
            nccl = torch.cuda.nccl.version()
            out.put(nccl_version=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
        except Exception as e:  # noqa: BLE001 - a version string is not worth a failed section
            out.put(nccl_version=f"? ({type(e).__name__})")
    env = s.LightningEnvironment()
    env.set_world_size(world)
    env.set_global_rank(rank)

    def init_pg() -> None:
        s.init_process_group(env, backend, rank, world, device, datetime.timedelta(seconds=60))

    def init_model() -> Any:
        model = _dense(p["width"], p["layers"]).to(device)  # built on the host, then moved: a usual start-up
        _sync(p["device"])
        return model

    _file_barrier(Path(p["barrier"]), rank, world)  # ranks start together: pg init is not a wait for a slow import
    start = time.perf_counter()
    if p["arm"] == "pg":
        init_pg()
    elif p["arm"] == "model":
        init_model()
    else:
        task = s.BackgroundTask(init_pg, phase=s.PROCESS_GROUP_INIT, name="ett-pg-init")  # as ETTStrategy does
        try:
            init_model()
        finally:
            task.join(timeout=120)
    out.put(seconds=time.perf_counter() - start)
    if p["arm"] == "model":
        return
    t = time.perf_counter()
    x = torch.ones(4, device=device)
    dist.all_reduce(x)  # the device group (NCCL on CUDA): formed eagerly, so this is one small collective
    _sync(p["device"])
    first = time.perf_counter() - t
    y = torch.ones(4)
    dist.all_reduce(y)  # the CPU group (gloo), which checkpoint writers use
    if x.cpu().tolist() != [float(world)] * 4 or y.tolist() != [float(world)] * 4:
        raise AssertionError(f"all_reduce of ones over {world} rank(s) gave {x.cpu().tolist()} / {y.tolist()}")
    out.put(first_allreduce_s=first, group_ok=True)
    dist.destroy_process_group()


def _file_barrier(directory: Path, rank: int, world: int, timeout_s: float = 60.0) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"ready-{rank}").touch()
    end = time.monotonic() + timeout_s
    while sum(1 for _ in directory.glob("ready-*")) < world:
        if time.monotonic() > end:
            raise TimeoutError(f"rank {rank}: the other ranks were not ready within {timeout_s:.0f} s")
        time.sleep(0.005)


def child_checkpoint(p: dict[str, Any], out: Reporter) -> None:
    """AsyncCheckpoint on one device: a fit without saves, a fit with saves, then a resume from the last one."""
    import torch

    c = import_callback_pieces()
    device, cuda = p["device"], p["device"] == "cuda"
    tmp = Path(p["tmp"])
    ckpt_dir = tmp / "ckpt"

    class Steps(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            while True:
                yield 0

    class Dense(c.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _dense(p["width"], p["layers"])

        def training_step(self, _batch, batch_idx):  # type: ignore[no-untyped-def]
            x = torch.randn(p["batch"], p["width"], device=self.device)
            return (self.net(x).squeeze(-1) - x.mean(-1)).pow(2).mean()

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class MemoryLogger(c.Logger):
        """Keeps what the callbacks log (AsyncCheckpoint's ``checkpoint/*`` after each durable save)."""

        def __init__(self) -> None:
            super().__init__()
            self.records: list[dict[str, float]] = []

        @property
        def name(self) -> str:
            return "memory"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics, step=None):  # type: ignore[no-untyped-def]
            self.records.append(dict(metrics))

        def log_hyperparams(self, params, *args, **kwargs):  # type: ignore[no-untyped-def]
            pass

        def saves(self) -> list[dict[str, float]]:
            return [r for r in self.records if "checkpoint/blocked_s" in r]

    class Monitor(c.ETTMonitor):
        """ETTMonitor minus its end-of-fit report: that needs rich and matplotlib, which the GPU image may lack;
        the phase split is read from the ledger below instead."""

        def teardown(self, trainer, pl_module, stage):  # type: ignore[no-untyped-def]
            self._patches.undo()

    class StepTimer(c.Callback):
        """Wall time between consecutive step ends, the device synchronized (first in the callback order)."""

        def __init__(self) -> None:
            self.last: float | None = None
            self.walls: list[tuple[str, float]] = []
            self.tag = "warmup"

        def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def]
            _sync(device)
            now = time.perf_counter()
            if self.last is not None:
                self.walls.append((self.tag, now - self.last))
            self.last = now

    def trainer(callbacks: list[Any], max_steps: int, logger: Any = False) -> Any:
        return c.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, max_steps=max_steps, logger=logger,
                         callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=any(isinstance(cb, c.AsyncCheckpoint) for cb in callbacks),
                         limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(tmp))

    def loader() -> Any:
        return torch.utils.data.DataLoader(Steps(), batch_size=None)

    torch.manual_seed(0)
    model = Dense()
    params = sum(q.numel() for q in model.parameters())
    out.put(params=params, param_bytes=4 * params, state_bytes_with_adam=12 * params, **_space(tmp))

    def without_saves(name: str, steps: int) -> list[float]:
        timer = StepTimer()
        trainer([timer, Monitor(run_dir=tmp / f"ett-{name}", report_on_end=False)], max_steps=steps + 5).fit(model, loader())
        return [w for _, w in timer.walls[4:]]

    # 1) warm-up (allocator, kernels), then saves every K steps: K adapted after each write to 1.5 writes' worth of
    #    steps, so a save does not find the previous one still writing (when_busy="skip" would drop it)
    warm = without_saves("warmup", p["base_steps"] // 2)
    out.put(step_s_warmup_median=statistics.median(warm))
    timer = StepTimer()
    logger = MemoryLogger()
    ckpt = c.AsyncCheckpoint(ckpt_dir, every_n_train_steps=p["first_save_at"], keep_last_n=2, resume=False)
    facts: dict[str, Any] = {}

    class Driver(c.Callback):
        """Runs before AsyncCheckpoint's hooks (Lightning puts Checkpoint callbacks last). Labels each save (the
        first, which allocates the staging buffers; measured; profiled; the final one of on_train_end), adapts K,
        and profiles from the end of the measured saves until 3 steps after the next save's boundary."""

        def __init__(self) -> None:
            self.started = time.monotonic()
            self.prof: Any = None
            self.profiled_at: int | None = None  # the step whose boundary made the profiled save
            self.labels: list[str] = []  # per submitted save, in order (the results arrive in the same order)
            self.ending = False

        def _label_new_saves(self) -> None:
            while len(self.labels) < ckpt.saves:
                self.labels.append("first (allocates staging)" if not self.labels else "final (on_train_end)"
                                   if self.ending else "profiled" if self.prof is not None else "measured")

        def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def]
            submitted = len(self.labels)
            self._label_new_saves()  # those submitted at the previous step's boundary
            step, saves = trainer.global_step, logger.saves()
            if "pinned" not in facts and ckpt._stager._buffers is not None:
                facts["pinned"] = _pinned(ckpt._stager._buffers)
            if saves and timer.tag in ("warmup", "measure"):
                step_s = statistics.median(w for _, w in timer.walls[-10:])
                write_s = max(r["checkpoint/write_s"] for r in saves)
                ckpt.every_n_train_steps = max(ckpt.every_n_train_steps, min(math.ceil(1.5 * write_s / step_s), 2000))
                facts["every_n_train_steps"] = ckpt.every_n_train_steps
            if timer.tag == "warmup" and saves:
                timer.tag = "measure"
            elif timer.tag == "measure" and sum(label == "measured" for label in self.labels[:len(saves)]) \
                    >= p["measured_saves"]:
                timer.tag = "profile"
                self.prof = _start_profiler(cuda)
            elif self.prof is not None:
                if self.profiled_at is None and "profiled" in self.labels[submitted:]:
                    self.profiled_at = step - 1
                if self.profiled_at is not None and step >= self.profiled_at + 3:  # its late copy has landed
                    facts["copy_streams"] = _stop_profiler(self.prof, tmp / "save_trace.json")
                    self.prof = None
                    trainer.should_stop = True
            if time.monotonic() - self.started > p["fit_cap_s"] and not trainer.should_stop:
                facts["stopped_by_time_cap_s"] = p["fit_cap_s"]
                trainer.should_stop = True

        def on_train_end(self, trainer, *args):  # type: ignore[no-untyped-def]
            self._label_new_saves()
            self.ending = True
            if self.prof is not None:
                self.prof.stop()
                self.prof = None

    driver = Driver()
    monitor = Monitor(run_dir=tmp / "ett-saves", report_on_end=False)
    fit = trainer([timer, monitor, driver, ckpt], max_steps=1_000_000, logger=logger)
    fit.fit(model, loader())
    driver._label_new_saves()
    saves = logger.saves()
    last_step = fit.global_step
    measured = [w for tag, w in timer.walls if tag == "measure"]
    per_save = [{"kind": label, "blocked_s": r["checkpoint/blocked_s"], "write_s": r["checkpoint/write_s"],
                 "bytes": r["checkpoint/bytes"], "overlapped_bytes": r["checkpoint/overlapped_bytes"]}
                for label, r in zip(driver.labels, saves)]
    out.put(walls_with_saves=[[tag, round(w, 6)] for tag, w in timer.walls])
    n_measured = sum(s["kind"] == "measured" for s in per_save)
    out.put(saves=per_save, skipped_saves=ckpt.skipped, staging_bytes=saves[-1]["checkpoint/staging_bytes"] if saves else 0,
            last_step=last_step, **facts)
    phases = c.summarize_run_dir(monitor.run_dir).phases
    out.put(phases={k: v for k, v in phases.items() if v > 0})
    reference = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}  # what the last save holds
    exp_avg = {i: s["exp_avg"].detach().cpu().clone() for i, s in enumerate(fit.optimizers[0].state.values())}

    # 2) the reference step time, on the same warm process, after the saves
    base = without_saves("base", p["base_steps"])
    mean_base = statistics.fmean(base)
    out.put(step_s_without_saves_median=statistics.median(base), step_s_without_saves_mean=mean_base,
            walls_without_saves=[round(w, 6) for w in base])
    if measured:
        mean_with = statistics.fmean(measured)
        out.put(step_s_with_saves_median=statistics.median(measured), step_s_with_saves_mean=mean_with,
                steps_measured=len(measured), step_overhead=mean_with / mean_base - 1,
                cost_per_save_s=(mean_with - mean_base) * len(measured) / max(n_measured, 1))

    # 3) the last checkpoint: complete (checksums), and a new model resumes from it bit for bit
    newest = c.layout.newest_complete(ckpt_dir, checksums=True)
    out.put(newest=str(newest), newest_is_last_step=newest is not None and newest.name == c.layout.checkpoint_name(last_step))

    class RestoreCheck(c.Callback):
        def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            state = pl_module.state_dict()
            opt = list(trainer.optimizers[0].state.values())
            facts["resume"] = {
                "global_step": trainer.global_step,
                "params_equal": all(torch.equal(state[k].cpu(), v) for k, v in reference.items()),
                "adam_state_equal": len(opt) == len(exp_avg)
                and all(torch.equal(opt[i]["exp_avg"].cpu(), v) for i, v in exp_avg.items()),
            }

    torch.manual_seed(1)
    t = time.perf_counter()
    resumed = c.AsyncCheckpoint(ckpt_dir, every_n_train_steps=10**6, save_on_train_end=False, resume=True)
    trainer([RestoreCheck(), resumed], max_steps=last_step + 1).fit(Dense(), loader())
    out.put(resume=facts.get("resume"), resume_fit_s=time.perf_counter() - t)


def _space(tmp: Path) -> dict[str, Any]:
    """Free space where checkpoints go and in /dev/shm (pinned staging buffers are shared memory: a container's
    default 64 MiB /dev/shm is too small for them)."""
    import shutil

    found: dict[str, Any] = {}
    for key, path in (("tmp_free_bytes", tmp), ("dev_shm_free_bytes", Path("/dev/shm"))):
        try:
            found[key] = shutil.disk_usage(path).free
        except OSError:
            found[key] = None
    return found


def _pinned(buffers: list[Any]) -> dict[str, Any]:
    """Of the staging buffers worth pinning (>= 1 KiB; 0-d scalars are never pinned), how many bytes are pinned."""
    import torch

    big = [b for b in buffers if isinstance(b, torch.Tensor) and b.numel() * b.element_size() >= 1024]
    pinned = sum(b.numel() * b.element_size() for b in big if b.is_pinned())
    return {"buffers": len(big), "bytes": sum(b.numel() * b.element_size() for b in big), "pinned_bytes": pinned}


def _start_profiler(cuda: bool) -> Any:
    """Device activity only on CUDA (kernels and copies, with their streams: a small trace); CPU ops on CPU."""
    import torch

    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    prof = torch.profiler.profile(activities=[activity])
    prof.start()
    return prof


def _stop_profiler(prof: Any, trace: Path) -> dict[str, Any]:
    prof.stop()
    prof.export_chrome_trace(str(trace))
    return copy_streams(json.loads(trace.read_text()).get("traceEvents", []))


def copy_streams(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Device-to-host copies by stream in a Chrome trace, against the stream most kernels ran on (the compute stream)."""
    kernels: dict[str, int] = defaultdict(int)
    d2h: dict[str, int] = defaultdict(int)
    kinds: dict[str, int] = defaultdict(int)
    for e in events:
        args, cat, name = e.get("args") or {}, str(e.get("cat", "")).lower(), str(e.get("name", ""))
        stream = str(args.get("stream", e.get("tid")))  # a GPU event's lane (tid) is its stream too
        if cat == "kernel":
            kernels[stream] += 1
        elif "memcpy" in cat and "DtoH" in name:  # "Memcpy DtoH (Device -> Pinned)", category gpu_memcpy
            d2h[stream] += int(args.get("bytes", 0) or 0)
            kinds[e["name"]] += int(args.get("bytes", 0) or 0)
    compute = max(kernels, key=kernels.__getitem__) if kernels else None
    return {"compute_stream": compute, "kernels_by_stream": dict(kernels), "d2h_bytes_by_stream": dict(d2h),
            "d2h_bytes_by_kind": dict(kinds)}


def child_compiled(p: dict[str, Any], out: Reporter) -> None:
    """One start of a compiled model: first-step time, compile counters, recompiles (with or without DynamicShapes)."""
    import torch

    c = import_callback_pieces()
    started = c.process_start_time()
    cuda = p["device"] == "cuda"
    sizes: list[int] = p["sizes"]

    class Batches(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(sizes)

        def __getitem__(self, i: int) -> Any:
            x = torch.randn(sizes[i], p["width"], generator=torch.Generator().manual_seed(i))
            return {"x": x, "y": x.mean(-1)}

    class Compiled(c.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[Any] = []
            for _ in range(p["layers"]):
                layers += [torch.nn.Linear(p["width"], p["width"]), torch.nn.LayerNorm(p["width"]), torch.nn.GELU()]
            self.net = torch.nn.Sequential(*layers, torch.nn.Linear(p["width"], 1))
            # CompileCache(compile_module=True) compiles the whole module; otherwise compile the net here.
            self.compiled = None if p["cache_dir"] else torch.compile(self.net, backend=p["backend"])

        def forward(self, x: Any) -> Any:
            return self.net(x)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            net = self if self.compiled is None else self.compiled
            return torch.nn.functional.mse_loss(net(batch["x"]).squeeze(-1), batch["y"])

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class FirstStep(c.Callback):
        at: float | None = None

        def on_train_batch_end(self, *args):  # type: ignore[no-untyped-def]
            if self.at is None:
                _sync(p["device"])
                self.at = time.time()

    first = FirstStep()
    callbacks: list[Any] = [first]
    dynamic = c.DynamicShapes(log_every_n_steps=1) if p["dynamic"] else None
    cache = c.CompileCache(p["cache_dir"], compile_module=True, compile_kwargs={"backend": p["backend"]}) \
        if p["cache_dir"] else None
    callbacks += [cb for cb in (dynamic, cache) if cb is not None]
    tracker = c.compile_tracker()
    trainer = c.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, max_epochs=1, logger=False, callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, default_root_dir=p["tmp"])
    model = Compiled()
    fit_start = time.time()
    trainer.fit(model, torch.utils.data.DataLoader(Batches(), batch_size=None, shuffle=False))
    from torch._dynamo.utils import counters

    assert first.at is not None
    triton_dir = Path(os.environ["TRITON_CACHE_DIR"])
    out.put(first_step_from_process_s=first.at - started, first_step_from_fit_s=first.at - fit_start,
            steps=trainer.global_step, recompiles=tracker.recompiles, graphs=tracker.compiles, compile_s=tracker.seconds,
            unique_graphs=counters["stats"]["unique_graphs"], **c.compile_metrics(),
            triton_bundler={k: v for k, v in counters["inductor"].items() if k.startswith("triton_bundler")},
            triton_cache_files=sum(1 for f in triton_dir.rglob("*") if f.is_file()) if triton_dir.is_dir() else 0,
            dynamic_shapes_metrics=dynamic.metrics() if dynamic else None, loaded=cache.loaded if cache else None)
    if cache is not None:
        info = Path(p["cache_dir"]) / "mega_cache.json"
        out.put(bundle=json.loads(info.read_text()) if info.is_file() else None)


def child_sleep(p: dict[str, Any], out: Reporter) -> None:
    """Only sleeps: the test of the time limit runs it."""
    out.put(slept="started")
    time.sleep(p["s"])


def child_hang(p: dict[str, Any], out: Reporter) -> None:
    """One rank of the hang case (see ``section_hang``); it serves its flight recorder and never returns by itself."""
    import torch
    import torch.distributed as dist

    from lightning_ett.watch import flight_recorder

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    out.put(serving=flight_recorder.serve(rank))
    cuda = p["backend"] == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(p["backend"], rank=rank, world_size=world, device_id=device if cuda else None)
    t = torch.ones(1 << 20, device=device)
    for _ in range(3):
        dist.all_reduce(t)
    _sync(device.type)
    Path(p["ready"], f"ready{rank}").touch()
    out.put(rank=rank, backend=p["backend"])
    if rank == 1 or (world == 1 and not cuda):
        while True:
            time.sleep(3600)  # the hang: it never enqueues the next collective
    if world == 1:  # one GPU: the all-reduce waits behind a GPU sleep, as it would wait for a peer
        torch.cuda._sleep(int(p["sleep_cycles"]))
    dist.all_reduce(t)
    t.sum().item()  # the host waits here: on CUDA a spin, outside any collective frame
    Path(p["ready"], "returned0").touch()
    while True:
        time.sleep(3600)


CHILDREN = {"pg": child_pg, "checkpoint": child_checkpoint, "compiled": child_compiled, "sleep": child_sleep,
            "hang": child_hang}


def child_main(name: str, params: str, result: str) -> int:
    for module in filter(None, os.environ.get(BLOCK_ENV, "").split(",")):
        sys.modules[module] = None  # type: ignore[assignment]  # an import of it now fails as if not installed
    out = Reporter(Path(result))
    try:
        CHILDREN[name](json.loads(params), out)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which prints it as a FAILED row
        traceback.print_exc()
        out.write({"ok": False, "figures": out.figures, "error": f"{type(e).__name__}: {e}"})
        return 1
    # What the GPU image may lack: lightning_ett's report module needs rich (and matplotlib), W&B needs wandb.
    out.write({"ok": True, "figures": {**out.figures, "needs_missing_optional": sorted(
        m for m in ("lightning_ett.instrument.report", "wandb") if sys.modules.get(m) is not None)}})
    return 0


# ====================================================================== parent
class ChildFailed(RuntimeError):
    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


@dataclass
class Section:
    name: str
    rows: list[tuple[str, str]] = field(default_factory=list)
    checks: list[tuple[str, bool | None, str]] = field(default_factory=list)  # (what, ok / None = n/a, detail)
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and all(ok is not False for _, ok, _ in self.checks)

    def row(self, item: str, value: str) -> None:
        self.rows.append((item, value))

    def check(self, what: str, ok: bool | None, detail: str = "") -> None:
        self.checks.append((what, ok, detail))


class Run:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp, self.device = args, tmp, args.device
        self.sizes = SIZES[args.device]
        self.start = time.monotonic()
        self.deadline = self.start + args.deadline
        self._n = 0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def child_env(self, tag: str, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_ETT_", "TORCHELASTIC_"))
               and k not in _DROP_ENV}
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(self.tmp / f"{tag}-inductor"),
                   TRITON_CACHE_DIR=str(self.tmp / f"{tag}-triton"))
        if self.args.without_torchrec:
            env[BLOCK_ENV] = ",".join(ABSENT_ON_GPU_IMAGE)
        env.update(extra)
        return env

    def children(self, name: str, params: dict[str, Any], limit_s: float, ranks: int = 0,
                 env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Run ``ranks`` copies of child ``name`` (0: one, not a distributed rank) and return their figures."""
        limit_s = min(limit_s, self.left() - 3)
        if limit_s < 5:
            raise TimeoutError(f"no time left in the {self.args.deadline:.0f} s budget for {name}")
        self._n += 1
        tag = f"{self._n:02d}-{name}"
        port = _free_port()
        procs = []
        for rank in range(max(ranks, 1)):
            extra = dict(env or {})
            if ranks:
                extra.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            result, log = self.tmp / f"{tag}-r{rank}.json", self.tmp / f"{tag}-r{rank}.log"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--params", json.dumps(params),
                   "--result", str(result)]
            with open(log, "w") as f:
                procs.append((subprocess.Popen(cmd, cwd=REPO, env=self.child_env(tag, **extra), stdout=f,
                                               stderr=subprocess.STDOUT, start_new_session=True), result, log))
        end, timed_out = time.monotonic() + limit_s, False
        try:
            while any(proc.poll() is None for proc, _, _ in procs):
                if time.monotonic() > end:
                    timed_out = True
                    break
                if any(proc.returncode not in (None, 0) for proc, _, _ in procs):
                    end = min(end, time.monotonic() + 5)  # a rank failed: its peers get 5 s, not the whole limit
                time.sleep(0.05)
        finally:  # also on SIGTERM or ^C of this script: no child outlives it
            for proc, _, _ in procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # the child and what it started (compile workers)
                    except ProcessLookupError:
                        pass  # it exited meanwhile
                proc.wait()
        results = [json.loads(r.read_text()) if r.is_file() else {"ok": False, "figures": {}} for _, r, _ in procs]
        figures = results[0].get("figures", {})
        errors, killed = [], []
        for rank, ((proc, _, log), res) in enumerate(zip(procs, results)):
            if proc.returncode == 0 and res.get("ok"):
                continue
            where = f" (rank {rank})" if ranks > 1 else ""
            if res.get("error"):
                errors.append(res["error"] + where)
            elif timed_out and proc.returncode == -signal.SIGKILL:
                killed.append(f"TimeoutError: child {name}{where} ran past its {limit_s:.0f} s limit (killed); "
                              f"last output: {_tail(log)}")
            else:
                errors.append(f"child {name}{where} exited with code {proc.returncode}; last output: {_tail(log)}")
        if errors or killed:
            raise ChildFailed("; ".join((errors + killed)[:2]), figures)  # a rank's own error before its peer's kill
        return [r["figures"] for r in results]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, lines: int = 3) -> str:
    try:
        text = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no output)"
    return " | ".join(text[-lines:])[-600:] or "(no output)"


# ---------------------------------------------------------------------- sections
def section_pg(run: Run, sec: Section) -> None:
    ranks = min(2, run.args.gpus) if run.device == "cuda" else 2
    arms: dict[str, list[dict[str, Any]]] = {}
    cap_end = time.monotonic() + SECTION_CAP_S["pg"]
    for arm in ("pg", "model", "both"):
        params = {"arm": arm, "device": run.device, "width": run.sizes["pg_width"], "layers": run.sizes["pg_layers"],
                  "barrier": str(run.tmp / f"barrier-{arm}")}
        arms[arm] = run.children("pg", params, limit_s=min(45.0, cap_end - time.monotonic()), ranks=ranks)
        sec.figures[arm] = arms[arm]
    first = arms["pg"][0]
    pg, model, both = (max(r["seconds"] for r in arms[a]) for a in ("pg", "model", "both"))
    sec.figures.update(pg_s=pg, model_s=model, both_s=both, overlap_ratio=both / (pg + model),
                       ideal_ratio=max(pg, model) / (pg + model))
    sec.row("backend, ranks", f"{first['backend']}, {ranks} rank(s)"
            + (f", {first.get('device_name')}, NCCL {first.get('nccl_version')}" if run.device == "cuda" else ""))
    if "cuda_context_s" in first:
        sec.row("CUDA context (before, not timed)", _s(max(r["cuda_context_s"] for r in arms["pg"])))
    mb = 4 * (run.sizes["pg_width"] ** 2 + run.sizes["pg_width"]) * run.sizes["pg_layers"] / 2**20
    sec.row("pg init alone (eager, device_id=)", _s(pg))
    sec.row(f"model init alone (~{mb:.0f} MiB, host -> device)", _s(model))
    sec.row("both, overlapped (wall)", _s(both))
    sec.row("overlap ratio: wall / (pg + model)",
            f"{both / (pg + model):.3f} (ideal max/sum {max(pg, model) / (pg + model):.3f})")
    sec.row("first all-reduce after init", _s(max(r["first_allreduce_s"] for r in arms["both"])))
    sec.check("group works after overlapped init (all-reduce device + gloo)", all(r.get("group_ok") for r in arms["both"]))


def section_checkpoint(run: Run, sec: Section) -> None:
    z = run.sizes
    params = {"device": run.device, "width": z["ckpt_width"], "layers": z["ckpt_layers"], "batch": z["ckpt_batch"],
              "tmp": str(run.tmp / "checkpoint"), "base_steps": z["base_steps"], "first_save_at": z["first_save_at"],
              "measured_saves": 3, "fit_cap_s": z["fit_cap_s"]}
    (run.tmp / "checkpoint").mkdir(exist_ok=True)
    try:
        (f,) = run.children("checkpoint", params, limit_s=SECTION_CAP_S["checkpoint"])
    except ChildFailed as e:
        _checkpoint_rows(sec, e.figures)  # what it measured before it failed
        raise
    finally:
        _rmtree(run.tmp / "checkpoint")  # ~3 GB of checkpoints on the GPU run
    sec.figures.update(f)
    _checkpoint_rows(sec, f)
    cuda = run.device == "cuda"
    pinned, phases = f.get("pinned"), f.get("phases", {})
    if cuda:  # is_pinned() of every buffer, or else CUPTI's word on the copies' destination ("Device -> Pinned")
        kinds = (f.get("copy_streams") or {}).get("d2h_bytes_by_kind") or {}
        cupti = bool(kinds) and all("Pinned" in kind for kind in kinds)
        sec.check("staging buffers pinned",
                  bool(pinned) and pinned["bytes"] > 0 and (pinned["pinned_bytes"] == pinned["bytes"] or cupti),
                  f"is_pinned: {pinned}; profiled copies: {list(kinds)}")
    else:
        sec.check("staging buffers pinned", None, "CPU run: nothing to pin")
    sec.check("device-to-host copy off the compute stream", *_stream_verdict(f.get("copy_streams"), cuda))
    measured = [s for s in f.get("saves", []) if s["kind"] == "measured"]
    capped = "stopped_by_time_cap_s" in f  # a slow disk: fewer saves fit in the time, not a failure of the callback
    sec.check(f"{params['measured_saves']} saves measured",
              True if len(measured) == params["measured_saves"] else (None if capped and measured else False),
              f"{len(measured)} measured, {f.get('skipped_saves')} skipped"
              + (f", stopped by the {f['stopped_by_time_cap_s']:.0f} s cap" if capped else ""))
    sec.check("checkpoint_save phase recorded", phases.get("checkpoint_save", 0) > 0, f"{phases.get('checkpoint_save', 0):.3f} s")
    sec.check("last checkpoint complete (checksums)", bool(f.get("newest_is_last_step")), f"newest {f.get('newest')}")
    resume = f.get("resume") or {}
    sec.check("resume restores step, params and Adam state", resume.get("global_step") == f.get("last_step")
              and bool(resume.get("params_equal")) and bool(resume.get("adam_state_equal")), f"{resume}")


def _checkpoint_rows(sec: Section, f: dict[str, Any]) -> None:
    """The checkpoint section's figures as rows; only those present (a failed child reports part of them)."""
    if "params" in f:
        sec.row("model", f"{f['params'] / 1e6:.1f} M params, {f['state_bytes_with_adam'] / 2**30:.2f} GiB with Adam state")
        sec.row("free space: checkpoint dir / /dev/shm", " / ".join(
            "?" if f.get(k) is None else f"{f[k] / 2**30:.1f} GiB" for k in ("tmp_free_bytes", "dev_shm_free_bytes")))
    if pinned := f.get("pinned"):
        sec.row("staging buffers (host)", f"{pinned['bytes'] / 2**20:.0f} MiB in {pinned['buffers']} buffers, "
                f"{pinned['pinned_bytes'] / 2**20:.0f} MiB pinned by is_pinned()")
    saves = f.get("saves", [])
    for s in saves:
        sec.row(f"save: {s['kind']}", f"blocked {_s(s['blocked_s'])}, written in {_s(s['write_s'])}, "
                f"{s['bytes'] / 2**20:.0f} MiB, {s['overlapped_bytes'] / 2**20:.0f} MiB copied while training ran")
    if measured := [s["blocked_s"] for s in saves if s["kind"] == "measured"]:
        sec.row("blocked per save (measured, median)", _s(statistics.median(measured)))
    if "every_n_train_steps" in f:
        sec.row("every_n_train_steps (after the first write)",
                f"{f['every_n_train_steps']}  (skipped saves: {f.get('skipped_saves')})")
    if "step_s_without_saves_mean" in f:
        sec.row("step time without saves (median / mean)",
                f"{_ms(f['step_s_without_saves_median'])} / {_ms(f['step_s_without_saves_mean'])}")
    if "step_s_with_saves_mean" in f:
        sec.row("step time with saves (median / mean)", f"{_ms(f['step_s_with_saves_median'])} / "
                f"{_ms(f['step_s_with_saves_mean'])}  ({100 * f['step_overhead']:+.2f} %, {f['steps_measured']} steps)")
        sec.row("cost per save (blocked + slowdown)", _s(f["cost_per_save_s"]))
    if phases := f.get("phases"):
        train, save = phases.get("train", 0.0), phases.get("checkpoint_save", 0.0)
        sec.row("ETTMonitor phases (fit with saves)", f"train {train:.2f} s, checkpoint_save {save:.3f} s "
                f"({100 * save / max(train + save, 1e-9):.2f} % of the two), compile {phases.get('compile', 0.0):.2f} s")


def _stream_verdict(streams: dict[str, Any] | None, cuda: bool) -> tuple[bool | None, str]:
    if not cuda:
        return None, "CPU run: no streams"
    if not streams:
        return None, "no profile"
    compute, d2h = streams["compute_stream"], streams["d2h_bytes_by_stream"]
    if compute is None:
        return None, f"no kernel in the profile (CUPTI unavailable?): {streams}"
    if not d2h:
        return None, f"no device-to-host copy in the profiled window: {streams}"
    on_compute = d2h.get(compute, 0)
    side = sum(v for k, v in d2h.items() if k != compute)
    detail = (f"compute stream {compute}: {on_compute / 2**20:.1f} MiB DtoH; other streams: {side / 2**20:.1f} MiB "
              f"({', '.join(streams['d2h_bytes_by_kind'])})")
    return side > 0 and on_compute <= 0.01 * side, detail


def section_dynamic_shapes(run: Run, sec: Section) -> None:
    arms = {}
    cap_end = time.monotonic() + SECTION_CAP_S["dynamic_shapes"]
    for arm in ("plain", "dynamic_shapes"):
        params = {"device": run.device, "width": run.sizes["compile_width"], "layers": run.sizes["compile_layers"],
                  "sizes": VARYING_BATCHES, "backend": run.args.backend, "dynamic": arm == "dynamic_shapes",
                  "cache_dir": None, "tmp": str(run.tmp)}
        (arms[arm],) = run.children("compiled", params, limit_s=min(80.0, cap_end - time.monotonic()))
        sec.figures[arm] = arms[arm]
    sec.row("batch sizes", ",".join(map(str, VARYING_BATCHES)) + f"  (backend {run.args.backend})")
    for arm, f in arms.items():
        sec.row(f"{arm}: recompiles / graphs", f"{f['recompiles']} / {f['graphs']}  (compile {_s(f['compile_s'])}, "
                f"dynamo unique_graphs {f['unique_graphs']})")
    plain, dyn = arms["plain"]["recompiles"], arms["dynamic_shapes"]["recompiles"]
    sec.check("DynamicShapes: no recompiles", dyn == 0, f"{dyn} recompile(s); without it {plain}")
    sec.check("its metrics agree", (arms["dynamic_shapes"]["dynamic_shapes_metrics"] or {}).get("compile/recompiles") == dyn,
              f"{arms['dynamic_shapes']['dynamic_shapes_metrics']}")


def section_compile_cache(run: Run, sec: Section) -> None:
    cache, fresh_host = run.tmp / "compile-cache", run.tmp / "compile-cache-bundle-only"
    cap_end = time.monotonic() + SECTION_CAP_S["compile_cache"]
    starts: dict[str, dict[str, Any]] = {}
    arms = (("cold", cache, 100.0), ("warm restart", cache, 60.0), ("fresh host, bundle only", fresh_host, 60.0))
    for arm, cache_dir, limit in arms:
        if arm.startswith("fresh"):
            fresh_host.mkdir()
            for name in ("mega_cache.bin", "mega_cache.json"):
                (fresh_host / name).write_bytes((cache / name).read_bytes())
        params = {"device": run.device, "width": run.sizes["compile_width"], "layers": run.sizes["compile_layers"],
                  "sizes": [run.sizes["compile_batch"]] * 3, "backend": "inductor", "dynamic": False,
                  "cache_dir": str(cache_dir), "tmp": str(run.tmp)}
        (starts[arm],) = run.children("compiled", params, limit_s=min(limit, cap_end - time.monotonic()))
        sec.figures[arm] = starts[arm]
    cold = starts["cold"]
    for arm, f in starts.items():
        sec.row(f"{arm}: first step (process / fit)", f"{_s(f['first_step_from_process_s'])} / {_s(f['first_step_from_fit_s'])}"
                f"  ratio {f['first_step_from_process_s'] / cold['first_step_from_process_s']:.3f} / "
                f"{f['first_step_from_fit_s'] / cold['first_step_from_fit_s']:.3f};  fx hits/misses "
                f"{f['compile/fx_cache_hits']:.0f}/{f['compile/fx_cache_misses']:.0f}, triton bundler {f['triton_bundler']}")
    sec.row("bundle", f"{(cold.get('bundle') or {}).get('artifacts')}")
    sec.figures.update(warm_cold_ratio=starts["warm restart"]["first_step_from_fit_s"] / cold["first_step_from_fit_s"],
                       fresh_host_cold_ratio=starts["fresh host, bundle only"]["first_step_from_fit_s"]
                       / cold["first_step_from_fit_s"])
    sec.check("cold start compiled and wrote the bundle", cold["compile/fx_cache_misses"] > 0 and bool(cold.get("bundle")),
              f"misses {cold['compile/fx_cache_misses']:.0f}, bundle {cold.get('bundle')}")
    for arm in ("warm restart", "fresh host, bundle only"):
        f = starts[arm]
        sec.check(f"{arm}: every graph from the cache", f["compile/fx_cache_hits"] > 0 and f["compile/fx_cache_misses"] == 0,
                  f"hits {f['compile/fx_cache_hits']:.0f}, misses {f['compile/fx_cache_misses']:.0f}, loaded {f['loaded']}")
    f = starts["fresh host, bundle only"]
    if run.device == "cuda":
        emitted = f["triton_bundler"].get("triton_bundler_read_and_emit_kernel", 0)
        sec.check("bundle carries the Triton kernels (fresh Triton cache filled from it)", emitted > 0,
                  f"{emitted} kernel(s) emitted from the bundle, {f['triton_cache_files']} file(s) in the Triton cache")
    else:
        sec.check("bundle carries the Triton kernels", None, "CPU run: no Triton")


def section_hang(run: Run, sec: Section) -> None:
    from lightning_ett.durable.procfs import sample_tree
    from lightning_ett.instrument.environment import launch_scratch_dir
    from lightning_ett.watch import flight_recorder
    from lightning_ett.watch.activity import activity_between
    from lightning_ett.watch.flight_recorder import behind
    from lightning_ett.watch.hang import Evidence, working

    gpus = run.args.gpus if run.device == "cuda" else 0
    cases = [("nccl", 2)] if gpus >= 2 else ([("nccl", 1), ("gloo", 2)] if gpus == 1 else [("gloo", 2)])
    for backend, ranks in cases:
        tag = f"{backend}-{ranks}"
        token, ready = f"gpucheck{os.getpid()}{tag.replace('-', '')}", run.tmp / f"hang-{tag}"
        ready.mkdir()
        params = {"backend": backend, "ready": str(ready), "sleep_cycles": 3 * 1_500_000_000}  # ~3 s at ~1.5 GHz
        env = {"LIGHTNING_ETT_LAUNCH_TOKEN": token, "LIGHTNING_ETT_ATTEMPT": "0"}
        procs = _start_ranks(run, "hang", params, ranks, env, tag)
        try:
            deadline = time.monotonic() + min(45.0, run.left() - 5)
            while not all((ready / f"ready{r}").exists() for r in range(ranks)) and time.monotonic() < deadline:
                if any(proc.poll() is not None for proc, _ in procs):
                    raise RuntimeError(f"a hang-case rank exited: {_tail(procs[0][1])} / {_tail(procs[-1][1])}")
                time.sleep(0.05)
            time.sleep(0.5)  # rank 0 is in its next all-reduce and at the host sync
            pids = {r: proc.pid for r, (proc, _) in enumerate(procs)}
            before, t0 = {r: sample_tree(pid) for r, pid in pids.items()}, time.monotonic()
            first = flight_recorder.request(token, 0, list(pids))
            time.sleep(1.5)
            second = flight_recorder.request(token, 0, list(pids))
            after, seconds = {r: sample_tree(pid) for r, pid in pids.items()}, time.monotonic() - t0
            activity = {r: activity_between(before[r], after[r], seconds) for r in pids if before[r] and after[r]}
            moved = working({r: Evidence(0.0, first[r]) for r in pids}, {r: Evidence(0.0, second[r]) for r in pids},
                            activity)
            named = behind({r: c for r, c in second.items() if c is not None}) if ranks > 1 else None
            figures = {"rank0_cpu_while_waiting": activity[0].cpu if 0 in activity else None,
                       "status": {r: ({k: [g.enqueued, g.completed] for k, g in c.groups.items()} if c else None)
                                  for r, c in second.items()},
                       "named": named[0] if named else None, "evidence": named[1] if named else None,
                       "working": moved, "returned0": (ready / "returned0").exists()}
            sec.figures[tag] = figures
        finally:
            for proc, _ in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            shutil.rmtree(launch_scratch_dir(token), ignore_errors=True)
        cpu = figures["rank0_cpu_while_waiting"]
        sec.row(f"{tag}: rank 0 CPU while it waits", "n/a" if cpu is None else f"{cpu:.0%} of a core")
        sec.row(f"{tag}: flight recorder (enqueued, completed)", json.dumps(figures["status"]))
        waiting = second.get(0) is not None and second[0].waiting
        sec.check(f"{tag}: rank 0's recorder answers with a collective pending", waiting)
        if ranks > 1:
            sec.row(f"{tag}: named", f"rank {figures['named']}: {figures['evidence']}")
            sec.check(f"{tag}: the recorder names rank 1", figures["named"] == 1)
            sec.check(f"{tag}: no rank counts as working", not moved, json.dumps(moved))
        if backend == "nccl":
            sec.check(f"{tag}: a CUDA wait spins (so CPU time is no evidence there)", cpu is not None and cpu > 0.5,
                      f"{cpu}")
            sec.check(f"{tag}: a spinning CUDA rank with a collective pending is not 'working'", 0 not in moved,
                      json.dumps(moved))


def _start_ranks(run: Run, name: str, params: dict[str, Any], ranks: int, env: dict[str, str],
                 tag: str) -> list[tuple[subprocess.Popen, Path]]:
    """``ranks`` children that keep running (``Run.children`` waits for children to end)."""
    port, procs = _free_port(), []
    for rank in range(ranks):
        extra = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = run.tmp / f"hang-{tag}-r{rank}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--params", json.dumps(params),
               "--result", str(run.tmp / f"hang-{tag}-r{rank}.json")]
        with open(log, "w") as f:
            procs.append((subprocess.Popen(cmd, cwd=REPO, env=run.child_env(f"hang-{tag}", **extra), stdout=f,
                                           stderr=subprocess.STDOUT, start_new_session=True), log))
    return procs


def torchrec_missing(run: Run, sec: Section, check: str, detail: str) -> bool:
    """TorchRec or fbgemm absent (or blocked by ``--without-torchrec``, as on the GPU image): say so, ``check`` n/a."""
    try:
        if run.args.without_torchrec:
            raise ImportError(name="torchrec")
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except ImportError as e:
        sec.row("status", f"not run: {e.name} is not installed (the GPU image has neither TorchRec nor fbgemm)")
        sec.check(check, None, detail)
        return True
    return False


def section_kernels_2d(run: Run, sec: Section) -> None:
    """Issue #32's decision to refuse ``fused_uvm_caching`` in 2D, where TorchRec and fbgemm (CUDA) are installed.

    (1) With HBM short, TorchRec's planner picks ``fused_uvm_caching`` for a 2-GPU group; under ETTStrategy's 2D
    constraints it picks ``fused_uvm``, and ``check_plan_2d`` refuses the cached plan. (2) On a GPU, the reason:
    after a training step of a ``MANAGED_CACHING`` table, ``split_embedding_weights()`` (what a replica sync
    averages) differs from the rows after ``flush()`` — the updated rows were only in the HBM cache.
    """
    if torchrec_missing(run, sec, "2D refuses fused_uvm_caching",
                        "n/a without TorchRec; tests/test_sparse_2d_config.py plans it on CPU"):
        return
    import torch
    from torchrec.distributed.planner import Topology
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from lightning_ett.durable.errors import ConfigurationError
    from lightning_ett.strategies.plan_cache import compute_plan, embedding_tables
    from lightning_ett.strategies.sharders import default_sharders
    from lightning_ett.strategies.sparse_2d import check_plan_2d, constraints_2d

    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=2_000_000, feature_names=[f"f{i}"])
               for i in range(4)]
    module = torch.nn.Sequential(EmbeddingBagCollection(tables=configs, device=torch.device("meta")))
    topology = Topology(world_size=2, compute_device="cuda", local_world_size=2, hbm_cap=256 * 2**20)
    free = compute_plan(module, topology, default_sharders("cuda"), {}, 512)
    kept = compute_plan(module, topology, default_sharders("cuda"), constraints_2d({}, embedding_tables(module), 2), 512)
    free_kernels = sorted({s.compute_kernel for s in free.plan["0"].values()})
    kept_kernels = sorted({s.compute_kernel for s in kept.plan["0"].values()})
    sec.row("planner kernels, 1D / 2D constraints", f"{free_kernels} / {kept_kernels}")
    try:
        check_plan_2d(free, 2)
        refused = False
    except ConfigurationError:
        refused = True
    sec.check("2D planner avoids fused_uvm_caching", "fused_uvm_caching" not in kept_kernels, str(kept_kernels))
    sec.check("a cached plan is refused", refused and "fused_uvm_caching" in free_kernels, str(free_kernels))
    if run.device != "cuda":
        sec.check("cache rows invisible to split_embedding_weights", None, "n/a on CPU")
        return
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

    rows, dim = 100_000, 64
    tbe = SplitTableBatchedEmbeddingBagsCodegen([(rows, dim, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA)],
                                                optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.5,
                                                cache_load_factor=0.2)
    ids = torch.randint(0, rows, (4096,), device="cuda")
    offsets = torch.arange(0, 4097, 4, device="cuda")
    tbe(ids, offsets).sum().backward()
    seen_by_sync = tbe.split_embedding_weights()[0].clone()
    tbe.flush()
    after_flush = tbe.split_embedding_weights()[0]
    stale = int((seen_by_sync != after_flush).any(dim=1).sum())
    sec.row("rows updated only in the HBM cache", f"{stale} of {len(ids.unique())} trained rows")
    sec.check("cache rows invisible to split_embedding_weights", stale > 0, f"{stale} stale rows before flush()")


def section_pipeline(run: Run, sec: Section) -> None:
    """Issue #33 on the device: ETTStrategy (input distribution pipelined, on CUDA on side streams) against
    ``TrainPipelineSparseDist`` and against itself unpipelined, where TorchRec and fbgemm are installed."""
    if torchrec_missing(run, sec, "the pipeline engaged on the device", "n/a without TorchRec"):
        return
    import torch

    ranks = min(torch.cuda.device_count(), 2) if run.device == "cuda" else 2
    steps = 200 if run.device == "cuda" else 40
    step_s, engaged = {}, 0
    cap_end = time.monotonic() + SECTION_CAP_S["pipeline"]
    for mode in ("pipeline", "lightning", "lightning_plain"):
        result = run.tmp / f"pipeline-{mode}.json"
        limit = min(60.0, cap_end - time.monotonic(), run.left() - 3)
        proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "throughput_job.py"), "--mode", mode, "--out",
                               str(result), "--steps", str(steps), "--device", run.device, "--ranks", str(ranks)],
                              check=False, cwd=REPO, env=run.child_env(f"pipeline-{mode}"), capture_output=True, text=True,
                              timeout=max(limit, 5))
        if proc.returncode != 0:
            raise RuntimeError(f"throughput_job --mode {mode} failed: {proc.stderr[-800:]}")
        figures = json.loads(result.read_text())
        step_s[mode] = figures["step_s"]
        engaged = figures.get("pipelined_calls", engaged) if mode == "lightning" else engaged
        sec.row(f"{mode}: steps/s", f"{1 / step_s[mode]:.1f}  ({ranks} rank(s), {steps} steps)")
    sec.figures.update(step_s=step_s, ranks=ranks, pipelined_calls=engaged)
    sec.row("ETTStrategy / TrainPipelineSparseDist", f"{step_s['pipeline'] / step_s['lightning']:.3f}  (one run each, "
            "in this order: a figure, not a verdict; benchmarks/throughput_vs_dmp.py alternates rounds)")
    sec.row("ETTStrategy / unpipelined", f"{step_s['lightning_plain'] / step_s['lightning']:.3f}")
    sec.check("the pipeline engaged on the device", engaged > 0, f"{engaged} pipelined sharded forwards")


SECTION_RUNNERS = {"pg": section_pg, "checkpoint": section_checkpoint, "dynamic_shapes": section_dynamic_shapes,
                   "compile_cache": section_compile_cache, "hang": section_hang, "kernels_2d": section_kernels_2d,
                   "pipeline": section_pipeline}
TITLES = {"pg": "process group", "checkpoint": "AsyncCheckpoint", "dynamic_shapes": "DynamicShapes",
          "compile_cache": "CompileCache", "hang": "hang watch", "kernels_2d": "2D kernels (#32)",
          "pipeline": "input pipeline (#33)"}


def _s(seconds: float) -> str:
    return f"{seconds:.3f} s"


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.2f} ms"


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def print_table(header: str, sections: list[Section], elapsed: float) -> None:
    width = max([38] + [len(item) for s in sections for item, _ in s.rows]
                + [len(w) + 7 for s in sections for w, _, _ in s.checks])
    print(header)
    print(f"{'section':<16}{'item':<{width + 2}}value")
    print("-" * (width + 2 + 16 + 40))
    for s in sections:
        label = f"{TITLES[s.name]}"
        for item, value in s.rows:
            print(f"{label:<16}{item:<{width + 2}}{value}")
            label = ""
        for what, ok, detail in s.checks:
            verdict = {True: "ok", False: "FAILED", None: "n/a"}[ok]
            print(f"{label:<16}{'check: ' + what:<{width + 2}}{verdict}{': ' + detail if detail else ''}")
            label = ""
        if s.error is not None:
            print(f"{label:<16}{'FAILED':<{width + 2}}{s.error}")
        print(f"{'':<16}{'section ' + ('ok' if s.ok else 'FAILED'):<{width + 2}}{s.seconds:.1f} s")
    print("-" * (width + 2 + 16 + 40))
    print(f"total elapsed {elapsed:.1f} s; {sum(s.ok for s in sections)}/{len(sections)} section(s) ok")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON of the figures (default: $OUT/gpu_check.json when $OUT is set)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {','.join(SECTIONS)}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run of every code path on CPU (gloo, small models; CUDA-only checks n/a)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the DynamicShapes section")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole run")
    parser.add_argument("--without-torchrec", action="store_true",
                        help=f"children block {', '.join(ABSENT_ON_GPU_IMAGE)} (as on the GPU image)")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--params", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if str(REPO) not in sys.path:  # the GPU image does not install the pack; the parent imports it too (hang)
        sys.path.insert(0, str(REPO))
    if args.child:
        return child_main(args.child, args.params, args.result)
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    if unknown := sorted(set(names) - set(SECTIONS)):
        parser.error(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: needs a CUDA GPU (torch {torch.__version__}: torch.cuda.is_available() is False); nothing to check.")
        return 0
    args.gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    out = args.out or (str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else None)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the children's clean-up
    try:
        return _run_sections(args, names, torch, out)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_sections(args: argparse.Namespace, names: list[str], torch: Any, out: str | None) -> int:
    started = time.monotonic()
    versions = _versions(torch)
    sections: list[Section] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        run = Run(args, Path(tmp))
        for name in names:
            sec = Section(name)
            t = time.monotonic()
            print(f"[gpu_check] {name} ...", flush=True)
            try:
                SECTION_RUNNERS[name](run, sec)
            except Exception as e:  # noqa: BLE001 - one section's failure is a row; the others still run
                sec.error = str(e) if isinstance(e, ChildFailed) else f"{type(e).__name__}: {e}"
                sec.figures.update(getattr(e, "figures", {}) or {})
            sec.seconds = time.monotonic() - t
            print(f"[gpu_check] {name}: {'ok' if sec.ok else 'FAILED'} in {sec.seconds:.1f} s", flush=True)
            sections.append(sec)
            if out:  # after every section: a run cut short still leaves what it measured
                _write_json(out, args, versions, sections, time.monotonic() - started)
    elapsed = time.monotonic() - started
    header = (f"gpu_check on {args.device} ({args.gpus} GPU(s)): torch {versions['torch']} (CUDA {versions['cuda']}), "
              f"lightning {versions['lightning']}, python {versions['python']}")
    print()
    print_table(header, sections, elapsed)
    if out:
        _write_json(out, args, versions, sections, elapsed)
        print(f"figures written to {out}")
    return 0 if all(s.ok for s in sections) else 1


def _write_json(out: str, args: argparse.Namespace, versions: dict[str, str], sections: list[Section],
                elapsed: float) -> None:
    payload = {"ok": all(s.ok for s in sections), "device": args.device, "gpus": args.gpus, "elapsed_s": elapsed,
               "versions": versions, "without_torchrec": args.without_torchrec, "cpus": os.cpu_count(),
               "sections": {s.name: {"ok": s.ok, "error": s.error, "seconds": s.seconds, "figures": s.figures,
                                     "checks": [{"check": w, "ok": k, "detail": d} for w, k, d in s.checks]}
                            for s in sections}}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(payload, indent=1, default=str))


def _versions(torch: Any) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        lightning = version("lightning")
    except PackageNotFoundError:
        lightning = "?"
    return {"torch": torch.__version__, "cuda": str(torch.version.cuda), "lightning": lightning,
            "python": sys.version.split()[0]}


if __name__ == "__main__":
    sys.exit(main())
