"""CompileCache: one persistent torch.compile cache for all attempts of a job."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ett.callbacks.metrics_logging import log_to_loggers
from lightning_ett.compile_events import CompileTracker, compile_tracker
from lightning_ett.fsutil import atomic_write_bytes, writable_dir_error

log = logging.getLogger(__name__)

ARTIFACTS = "mega_cache.bin"
ARTIFACTS_INFO = "mega_cache.json"


class CompileCache(Callback):
    r"""Make PT2's caches persistent and shared across a job's restarts.

    * ``<cache_dir>/inductor`` becomes inductor's cache directory (FX graph, AOTAutograd and
      autotuning caches, and on CPU the compiled C++ libraries, which the portable bundle below
      does not carry).
    * ``torch.compiler.config.job_id`` is set to a value stable across restarts (``job_id``, or
      one derived from ``cache_dir``), so automatic-dynamic profiles (PGO) recorded by one
      attempt make the next compile varying dimensions dynamic at once.
    * Saved artifacts (``torch.compiler.save_cache_artifacts``, PT2's portable "mega-cache") are
      loaded before the first step, and saved by global rank 0 — written atomically — once the
      first training step and the first validation have compiled (and again at the end of
      training if anything new compiled). A bundle written by another torch version is ignored
      with a warning.
    * ``autotune_pruning`` keeps inductor's GEMM autotuning search space at its default (not
      exhaustive) and its results in the local (persistent) cache; ``batch_fusion`` turns on
      PT2's pre-/post-grad batch-fusion passes for recommendation models, where supported.
    * ``compile_module=True`` compiles the LightningModule (``module.compile(**compile_kwargs)``);
      otherwise it works with your own ``torch.compile`` calls.

    Logged from rank zero: ``compile/dynamo_s`` (tracing, which no cache removes),
    ``compile/backend_s``, ``compile/fx_cache_hits|misses`` and ``compile/aot_cache_hits|misses``;
    each compilation is a ``compile`` phase on the ETT timeline.

    Security: the cache files are pickles. They are loaded only from ``cache_dir``; give it a
    directory only your jobs can write.
    """

    def __init__(
        self,
        cache_dir: str | Path,
        job_id: str | None = None,
        compile_module: bool = False,
        compile_kwargs: dict[str, Any] | None = None,
        autotune_pruning: bool = True,
        batch_fusion: bool = False,
    ) -> None:
        if not isinstance(cache_dir, (str, Path)) or not str(cache_dir):
            raise TypeError(f"CompileCache(cache_dir={cache_dir!r}): expected a directory path (str or Path).")
        if job_id is not None and (not isinstance(job_id, str) or not job_id):
            raise ValueError(f"CompileCache(job_id={job_id!r}): expected a non-empty string or None.")
        if compile_kwargs is not None and not isinstance(compile_kwargs, dict):
            raise TypeError(f"CompileCache(compile_kwargs={compile_kwargs!r}): expected a dict of torch.compile arguments.")
        self.cache_dir = Path(cache_dir).absolute()
        self.job_id = job_id or "lightning-ett-" + hashlib.sha1(str(self.cache_dir).encode()).hexdigest()[:12]
        self.compile_module = compile_module
        self.compile_kwargs = dict(compile_kwargs or {})
        self.autotune_pruning = autotune_pruning
        self.batch_fusion = batch_fusion
        self.loaded: dict[str, int] = {}
        self._tracker: CompileTracker | None = None
        self._saved_at_compiles = -1
        self._validated = False

    # ------------------------------------------------------------------ set-up: before anything compiles
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        inductor_dir = self.cache_dir / "inductor"
        if error := writable_dir_error(inductor_dir, "CompileCache(cache_dir", trainer.global_rank):
            raise PermissionError(str(error).replace(str(inductor_dir), str(self.cache_dir)))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)  # read by inductor at every cache lookup
        torch.compiler.config.job_id = self.job_id
        if self.autotune_pruning:
            torch._inductor.config.max_autotune_gemm_search_space = "DEFAULT"
            torch._inductor.config.autotune_local_cache = True
        if self.batch_fusion:
            self._enable_batch_fusion()
        self._tracker = compile_tracker()
        if trainer.strategy.root_device.type == "cpu":
            _probe_cpu_isa_in_background()
        self._load_artifacts()
        if self.compile_module:
            pl_module.compile(**self.compile_kwargs)

    def _enable_batch_fusion(self) -> None:
        try:
            from torch._inductor.fx_passes.group_batch_fusion import POST_GRAD_FUSIONS, PRE_GRAD_FUSIONS
        except ImportError:
            rank_zero_warn("CompileCache(batch_fusion=True): this torch has no batch-fusion passes; ignored.")
            return
        torch._inductor.config.pre_grad_fusion_options = {name: {} for name in PRE_GRAD_FUSIONS}
        torch._inductor.config.post_grad_fusion_options = {name: {} for name in POST_GRAD_FUSIONS}

    def _load_artifacts(self) -> None:
        blob, info = self.cache_dir / ARTIFACTS, self.cache_dir / ARTIFACTS_INFO
        if not blob.is_file():
            return
        try:
            written_by = json.loads(info.read_text()).get("torch")
        except (OSError, ValueError):
            written_by = None
        if written_by != torch.__version__:
            rank_zero_warn(f"CompileCache: ignoring {str(blob)!r}, written by torch {written_by}, not {torch.__version__}.")
            return
        try:
            cache_info = torch.compiler.load_cache_artifacts(blob.read_bytes())
        except Exception as e:  # noqa: BLE001 - a cache must never stop training
            rank_zero_warn(f"CompileCache: could not load {str(blob)!r} ({e!r}); compiling from scratch.")
            return
        if cache_info is not None:
            self.loaded = _counts(cache_info)
            rank_zero_info(f"CompileCache: loaded compile artifacts from {blob}: {self.loaded}")

    # ------------------------------------------------------------------ saving once compilation settled
    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._saved_at_compiles < 0:  # the first training step (forward and backward) has compiled
            self._save(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and not self._validated:
            self._validated = True
            self._save(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer)
        log_to_loggers(trainer, self.metrics())

    def _save(self, trainer: pl.Trainer) -> None:
        tracker = self._tracker or compile_tracker()
        if tracker.compiles == self._saved_at_compiles:
            return  # nothing new compiled since the last save
        self._saved_at_compiles = tracker.compiles
        if not trainer.is_global_zero or not _compiled_anything_new():
            return  # all cache hits: the bundle on disk already holds these artifacts
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        blob, cache_info = saved
        atomic_write_bytes(self.cache_dir / ARTIFACTS, blob)
        counts = _counts(cache_info)
        atomic_write_bytes(self.cache_dir / ARTIFACTS_INFO, json.dumps({"torch": torch.__version__, "artifacts": counts}).encode())
        rank_zero_info(f"CompileCache: saved {len(blob) / 2**20:.1f} MiB of compile artifacts to {self.cache_dir / ARTIFACTS}")

    def metrics(self) -> dict[str, float]:
        from torch._dynamo.utils import compilation_time_metrics, counters

        def total(key: str) -> float:
            return float(sum(compilation_time_metrics.get(key, [])))

        backend = total("OutputGraph.call_user_compiler") + total("backward._backward_impl")
        return {
            "compile/dynamo_s": max(total("_compile.compile_inner") - total("OutputGraph.call_user_compiler"), 0.0),
            "compile/backend_s": backend,
            "compile/fx_cache_hits": float(counters["inductor"]["fxgraph_cache_hit"]),
            "compile/fx_cache_misses": float(counters["inductor"]["fxgraph_cache_miss"]),
            "compile/aot_cache_hits": float(counters["aot_autograd"]["autograd_cache_hit"]),
            "compile/aot_cache_misses": float(counters["aot_autograd"]["autograd_cache_miss"]),
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"cache_dir": str(self.cache_dir), "job_id": self.job_id}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # the cache lives on disk; job_id comes from the constructor so a restart computes the same one


def _probe_cpu_isa_in_background() -> None:
    """Start inductor's CPU vector-ISA probe now, in a thread, instead of inside the first compile.

    Inductor's first CPU compile in a process checks which vector ISAs (AVX2, AVX-512…) work
    by building and loading probe libraries in ~10 subprocesses: 1.2 s here, paid on every
    restart even when every graph comes from the cache (no cache keeps it: it describes this
    host). Run from ``setup`` it overlaps with the rest of start-up and with Dynamo's tracing
    of the first step; the result is ``functools.cache``-d, so the compile then finds it done.
    """
    def probe() -> None:
        try:
            from torch._inductor.cpu_vec_isa import pick_vec_isa

            pick_vec_isa()
        except Exception as e:  # noqa: BLE001 - only a head start: the compile will probe itself
            log.debug(f"CompileCache: background ISA probe failed ({e!r}); the first compile will probe")

    threading.Thread(target=probe, name="ett-inductor-isa-probe", daemon=True).start()


def _counts(cache_info: Any) -> dict[str, int]:
    return {kind: len(keys) for kind, keys in getattr(cache_info, "artifacts", {}).items()}


def _compiled_anything_new() -> bool:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"] > 0
