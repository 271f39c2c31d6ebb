"""lightning-ett: raise the Effective Training Time of Lightning + TorchRec jobs.

Public names load on first use (PEP 562), so ``lightning run`` and ``lightning-ett report``
start without importing Lightning and TorchRec: their start-up is part of every job's
wall time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_ett.callbacks import (
        AsyncCheckpoint,
        CheckpointWriteError,
        CompileCache,
        DynamicShapes,
        ETTMonitor,
        FP8Probe,
        ModelPublisher,
        ModelPublishError,
    )
    from lightning_ett.fp8.emulate import emulate_float8_training
    from lightning_ett.instrument.summary import Summary, summarize, summarize_run_dir
    from lightning_ett.instrument.timeline import Phase, get_timeline, record_phase
    from lightning_ett.publish.artifact import load_published
    from lightning_ett.strategies import ETTStrategy

__version__ = "0.1.0"

_WHERE = {
    "AsyncCheckpoint": "lightning_ett.callbacks", "CheckpointWriteError": "lightning_ett.callbacks",
    "CompileCache": "lightning_ett.callbacks", "DynamicShapes": "lightning_ett.callbacks",
    "ETTMonitor": "lightning_ett.callbacks", "ETTStrategy": "lightning_ett.strategies", "FP8Probe": "lightning_ett.callbacks",
    "emulate_float8_training": "lightning_ett.fp8.emulate",
    "ModelPublisher": "lightning_ett.callbacks", "ModelPublishError": "lightning_ett.callbacks",
    "load_published": "lightning_ett.publish.artifact",
    "Summary": "lightning_ett.instrument.summary", "summarize": "lightning_ett.instrument.summary",
    "summarize_run_dir": "lightning_ett.instrument.summary",
    "Phase": "lightning_ett.instrument.timeline", "get_timeline": "lightning_ett.instrument.timeline",
    "record_phase": "lightning_ett.instrument.timeline",
}
__all__ = [
    "AsyncCheckpoint", "CheckpointWriteError", "CompileCache", "DynamicShapes", "ETTMonitor", "ETTStrategy", "FP8Probe",
    "ModelPublishError", "ModelPublisher", "Phase", "Summary", "emulate_float8_training", "get_timeline", "load_published",
    "record_phase", "summarize", "summarize_run_dir",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        try:  # a submodule, as `lightning_ett.instrument.summary` after a bare `import lightning_ett`
            return importlib.import_module(f"lightning_ett.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'lightning_ett' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
