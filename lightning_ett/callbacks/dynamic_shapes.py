"""DynamicShapes: mark the batch dimension dynamic before Dynamo specializes on it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_ett.callbacks.loggers import log_to_loggers
from lightning_ett.compile.shapes import batch_size, mark_batch_dynamic, mark_compiled_inputs
from lightning_ett.durable.errors import ConfigurationError
from lightning_ett.instrument.compile_events import CompileTracker, compile_tracker
from lightning_ett.patching import Patches

__all__ = ["DynamicShapes", "mark_batch_dynamic"]

class DynamicShapes(Callback):
    r"""Mark batch dimensions dynamic so a smaller last batch or variable feature lengths do not recompile.

    Before every training, validation, test and predict step the batch's tensors (also inside
    dicts, lists, tuples and dataclasses such as TorchRec's ``Batch``) get their ``batch_dim``
    marked with ``torch._dynamo.maybe_mark_dynamic``; ``KeyedJaggedTensor`` values, lengths,
    weights and offsets get their flat dimension marked. A mark does not carry through eager code,
    so each compiled submodule (``module.compile()`` or ``torch.compile(module)``) also marks
    ``batch_dim`` of the tensors it is called with that have the batch's size (a top MLP fed the
    concatenation of dense features and embeddings). Works with any ``torch.compile``-d module;
    costs nothing when nothing is compiled.

    It also counts compilations from Dynamo's compile callbacks: ``compile/recompiles`` (a frame
    compiled again), ``compile/graphs``, ``compile/graph_breaks`` and ``compile/seconds`` are
    logged from rank zero to every logger every ``log_every_n_steps`` steps, each compilation is
    a ``compile`` phase on the ETT timeline, and a warning names the frame that comes within one
    compilation of ``torch._dynamo.config.recompile_limit`` (past it, Dynamo stops compiling that
    frame and runs it eagerly).

    Args:
        batch_dim: the batch dimension of plain tensors in the batch.
        log_every_n_steps: how often (training steps) the counts are logged.
    """

    def __init__(self, batch_dim: int = 0, log_every_n_steps: int = 50) -> None:
        if not isinstance(batch_dim, int) or isinstance(batch_dim, bool) or batch_dim < 0:
            raise ConfigurationError(f"DynamicShapes(batch_dim={batch_dim!r}): expected an int >= 0 (usually 0).")
        if not isinstance(log_every_n_steps, int) or isinstance(log_every_n_steps, bool) or log_every_n_steps < 1:
            raise ConfigurationError(f"DynamicShapes(log_every_n_steps={log_every_n_steps!r}): expected an int >= 1.")
        self.batch_dim = batch_dim
        self.log_every_n_steps = log_every_n_steps
        self._tracker: CompileTracker | None = None
        self._warned_frames: set[int] = set()
        self._patches = Patches()
        self._wrapped: set[int] = set()  # compiled submodules whose calls mark their inputs
        self._batch_size: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._tracker = compile_tracker()

    def _stage_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Once set up (``configure_model`` and the strategy's wrapping done): wrap the compiled submodules."""
        mark_compiled_inputs(pl_module, self._patches, lambda: self._batch_size, self.batch_dim, self._wrapped)

    on_train_start = on_validation_start = on_test_start = on_predict_start = _stage_start

    def _batch_start(self, batch: Any) -> None:
        mark_batch_dynamic(batch, self.batch_dim)
        self._batch_size = batch_size(batch, self.batch_dim)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_start(batch)

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._batch_start(batch)

    on_test_batch_start = on_validation_batch_start  # same signature, same job
    on_predict_batch_start = on_validation_batch_start

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_size = None  # outside a step (an epoch-end hook) no argument is taken for the batch's

    on_test_batch_end = on_validation_batch_end
    on_predict_batch_end = on_validation_batch_end

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._patches.undo()
        self._wrapped.clear()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._patches.undo()
        self._wrapped.clear()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._batch_size = None
        self._warn_near_limit()
        if trainer.global_step % self.log_every_n_steps == 0:
            self._log(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer)

    def metrics(self) -> dict[str, float]:
        t = self._tracker or compile_tracker()
        return {"compile/recompiles": float(t.recompiles), "compile/graphs": float(t.compiles),
                "compile/graph_breaks": float(t.graph_breaks()), "compile/seconds": t.seconds}

    def _log(self, trainer: pl.Trainer) -> None:
        log_to_loggers(trainer, self.metrics())

    def _warn_near_limit(self) -> None:
        if self._tracker is None:
            return
        limit = int(getattr(torch._dynamo.config, "recompile_limit", getattr(torch._dynamo.config, "cache_size_limit", 8)))
        for frame, count in self._tracker.compiles_per_frame.items():
            if count >= limit - 1 and frame not in self._warned_frames:
                self._warned_frames.add(frame)
                rank_zero_warn(
                    f"DynamicShapes: compiled frame {frame} has been compiled {count} times; at "
                    f"torch._dynamo.config.recompile_limit={limit} Dynamo stops compiling it and runs it eagerly. "
                    "Run with TORCH_LOGS=recompiles to see which guard fails."
                )
