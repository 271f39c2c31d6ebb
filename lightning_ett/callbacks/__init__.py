"""Lightning callbacks of lightning-ett."""

from lightning_ett.callbacks.checkpoint import AsyncCheckpoint, CheckpointWriteError
from lightning_ett.callbacks.compile_cache import CompileCache
from lightning_ett.callbacks.dynamic_shapes import DynamicShapes, mark_batch_dynamic
from lightning_ett.callbacks.monitor import ETTMonitor
from lightning_ett.callbacks.publisher import ModelPublisher, ModelPublishError
from lightning_ett.instrument.environment import mark_imported

__all__ = ["AsyncCheckpoint", "CheckpointWriteError", "CompileCache", "DynamicShapes", "ETTMonitor", "ModelPublishError",
           "ModelPublisher", "mark_batch_dynamic"]

mark_imported()  # the ``import`` phase ends once Lightning and torch are in
