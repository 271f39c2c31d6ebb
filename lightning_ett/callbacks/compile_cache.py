"""CompileCache: one persistent torch.compile cache for all attempts of a job."""

from __future__ import annotations

import atexit
import hashlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ett.callbacks.loggers import log_to_loggers
from lightning_ett.compile.cache import (
    ARTIFACTS,
    ARTIFACTS_INFO,
    GATE_TIMEOUT_S,
    Bundle,
    IsaProbe,
    compile_metrics,
    configure,
)
from lightning_ett.compile.shapes import compiled_submodules
from lightning_ett.durable.errors import ConfigurationError, ConfigurationTypeError
from lightning_ett.durable.files import writable_dir_error
from lightning_ett.instrument.compile_events import CompileTracker, compile_tracker
from lightning_ett.patching import Patches

__all__ = ["ARTIFACTS", "ARTIFACTS_INFO", "CompileCache"]


#: How long a process's exit waits for an ISA probe still running after an exception: a probe takes 1-5 s; a
#: launcher gives a stopping worker about 30 s before SIGKILL, and other exit handlers (a logger's last sync) need some.
EXIT_WAIT_S = 15.0


class CompileCache(Callback):
    r"""Make PT2's caches persistent and shared across a job's restarts.

    * ``<cache_dir>/inductor`` becomes inductor's cache directory (FX graph, AOTAutograd and
      autotuning caches, and on CPU the compiled C++ libraries, which the portable bundle below
      does not carry), and inductor's CPU precompiled header, which inductor otherwise keeps in
      ``/tmp`` and a restart on a host with an empty ``/tmp`` built again (5-8 s): one per host
      CPU, a torn one removed at setup (see :mod:`lightning_ett.compile.headers`).
    * ``torch.compiler.config.job_id`` is set to a value stable across restarts (``job_id``, or
      one derived from ``cache_dir``), so automatic-dynamic profiles (PGO) recorded by one
      attempt make the next compile varying dimensions dynamic at once.
    * Saved artifacts (``torch.compiler.save_cache_artifacts``, PT2's portable "mega-cache") are
      loaded before the first step, and saved by global rank 0 — written atomically — once the
      first training step and the first validation have compiled (and again at the end of
      training if anything new compiled). A bundle that does not load (corrupted, or written
      by another torch version) is named in a warning, set aside, and written anew.
    * ``autotune_pruning`` keeps inductor's GEMM autotuning search space at its default (not
      exhaustive) and its results in the local (persistent) cache; ``batch_fusion`` turns on
      PT2's pre-/post-grad batch-fusion passes for recommendation models, where supported.
    * ``compile_module=True`` compiles the LightningModule (``module.compile(**compile_kwargs)``);
      otherwise it works with your own ``torch.compile`` calls.

    These settings (``TORCHINDUCTOR_CACHE_DIR``, ``torch.compiler.config.job_id``, inductor
    config) hold from ``setup`` to ``teardown`` and are then restored.

    Logged from rank zero: ``compile/dynamo_s`` (tracing, which no cache removes),
    ``compile/backend_s``, ``compile/fx_cache_hits|misses``, ``compile/aot_cache_hits|misses`` and
    ``compile/cpp_compiles`` / ``compile/cpp_compile_s`` (C++ compiler runs: kernels, the
    precompiled header, the ISA probe; a warm CPU restart runs one, inductor's ~0.1 s header
    preprocessing);
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
            raise ConfigurationTypeError(f"CompileCache(cache_dir={cache_dir!r}): expected a directory path (str or Path).")
        if job_id is not None and (not isinstance(job_id, str) or not job_id):
            raise ConfigurationError(f"CompileCache(job_id={job_id!r}): expected a non-empty string or None.")
        if compile_kwargs is not None and not isinstance(compile_kwargs, dict):
            raise ConfigurationTypeError(
                f"CompileCache(compile_kwargs={compile_kwargs!r}): expected a dict of torch.compile arguments.")
        self.cache_dir = Path(cache_dir).absolute()
        self.job_id = job_id or "lightning-ett-" + hashlib.sha1(str(self.cache_dir).encode()).hexdigest()[:12]
        self.compile_module = compile_module
        self.compile_kwargs = dict(compile_kwargs or {})
        self.autotune_pruning = autotune_pruning
        self.batch_fusion = batch_fusion
        self.loaded: dict[str, int] = {}
        self._bundle = Bundle(self.cache_dir)
        self._patches = Patches()
        self._tracker: CompileTracker | None = None
        self._saved_at_compiles = -1
        self._validated = False
        self._isa_probe: IsaProbe | None = None

    # ------------------------------------------------------------------ set-up: before anything compiles
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        inductor_dir = self.cache_dir / "inductor"
        if error := writable_dir_error(inductor_dir, "CompileCache(cache_dir", trainer.global_rank):
            raise PermissionError(str(error).replace(str(inductor_dir), str(self.cache_dir)))
        configure(self._patches, inductor_dir, self.job_id, self.autotune_pruning, self.batch_fusion)
        self._tracker = compile_tracker()
        self._start_isa_probe(trainer, pl_module, compiling=self.compile_module)
        problem = self._bundle.load(owner=trainer.is_global_zero)  # every rank fills its caches; rank 0 heals
        if problem is not None:
            rank_zero_warn(problem)
        self.loaded = self._bundle.loaded
        if self.loaded:
            rank_zero_info(f"CompileCache: loaded compile artifacts from {self._bundle.blob}: {self.loaded}")
        if self.compile_module:
            pl_module.compile(**self.compile_kwargs)

    def _start_isa_probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule, compiling: bool = False) -> None:
        """On CPU, where a module is (or will be) compiled: inductor's ISA probe in the background (why: IsaProbe)."""
        if self._isa_probe is None and trainer.strategy.root_device.type == "cpu" and (
                compiling or compiled_submodules(pl_module)):
            self._isa_probe = IsaProbe()  # inductor's own ISA lookups wait for it

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_isa_probe(trainer, pl_module)  # modules compiled in configure_model are there now

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
            return  # nothing compiled since the last save
        self._saved_at_compiles = tracker.compiles
        if not trainer.is_global_zero or tracker.compiles == 0:
            return
        size = self._bundle.save()
        if size is not None:
            rank_zero_info(f"CompileCache: saved {size / 2**20:.1f} MiB of compile artifacts to {self._bundle.blob}")

    def metrics(self) -> dict[str, float]:
        return compile_metrics()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._end()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # (Lightning calls no teardown after an exception.) The process's exit waits for a probe still running, not
        # this hook: the callbacks after this one (a preemption's final save, within the scheduler's grace period)
        # run first.
        if self._isa_probe is not None and not self._isa_probe.done.is_set():
            atexit.register(self._isa_probe.wait, EXIT_WAIT_S)
        self._patches.undo()

    def _end(self) -> None:
        if self._isa_probe is not None:  # done already if anything compiled; a process ending mid-build leaves
            self._isa_probe.wait(timeout=GATE_TIMEOUT_S)  # a partial library inductor never rebuilds
        self._patches.undo()  # (the probe's gate takes itself away when the probe ends: IsaProbe)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"cache_dir": str(self.cache_dir), "job_id": self.job_id}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the cache lives on disk; ``job_id`` comes from the constructor (a restart computes the same)."""
