"""Lightning callbacks of lightning-ett."""

from lightning_ett.callbacks.checkpoint import AsyncCheckpoint, CheckpointWriteError
from lightning_ett.callbacks.compile_cache import CompileCache
from lightning_ett.callbacks.dynamic_shapes import DynamicShapes, mark_batch_dynamic
from lightning_ett.callbacks.monitor import ETTMonitor
from lightning_ett.callbacks.publisher import ModelPublisher, ModelPublishError
from lightning_ett.instrument.environment import mark_imported

__all__ = ["AsyncCheckpoint", "CheckpointWriteError", "CompileCache", "DynamicShapes", "ETTMonitor", "FP8Probe",
           "ModelPublishError", "ModelPublisher", "mark_batch_dynamic"]

mark_imported()  # the ``import`` phase ends once Lightning and torch are in


def __getattr__(name: str) -> object:
    """FP8Probe loads on first use: torchao is not every job's import time."""
    if name == "FP8Probe":
        from lightning_ett.callbacks.fp8_probe import FP8Probe

        return FP8Probe
    raise AttributeError(f"module 'lightning_ett.callbacks' has no attribute {name!r}")
