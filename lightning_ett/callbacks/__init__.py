"""Lightning callbacks of lightning-ett."""

from lightning_ett.callbacks.monitor import ETTMonitor

__all__ = ["ETTMonitor"]
