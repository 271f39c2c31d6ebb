"""lightning-ett: raise the Effective Training Time of Lightning + TorchRec jobs."""

from lightning_ett.callbacks import AsyncCheckpoint, CheckpointWriteError, CompileCache, DynamicShapes, ETTMonitor
from lightning_ett.environment import mark_imported
from lightning_ett.strategies import ETTStrategy
from lightning_ett.summary import Summary, summarize, summarize_run_dir
from lightning_ett.timeline import Phase, get_timeline, record_phase

__version__ = "0.1.0"
__all__ = ["AsyncCheckpoint", "CheckpointWriteError", "CompileCache", "DynamicShapes", "ETTMonitor", "ETTStrategy", "Phase", "Summary", "get_timeline", "record_phase", "summarize", "summarize_run_dir"]

mark_imported()  # the ``import`` phase ends here, after Lightning and torch are in
