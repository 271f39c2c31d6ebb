"""A cheaper form of Lightning's per-step SIGTERM broadcast.

Lightning 2.6 broadcasts a "rank 0 got SIGTERM" flag from the root device and reads it
back with ``.item()`` at *every* training step: a blocking collective per step and, on
GPUs, a device synchronization per step. Its SIGTERM handler on rank 0 adds one more
blocking broadcast, from inside the signal handler, to pair with the other ranks' next one.

This keeps the guarantee (every rank stops when rank 0 is told to) with a CPU tensor
(gloo, also in a ``cpu:gloo,cuda:nccl`` group) sent asynchronously and only every
``interval`` steps: each broadcast waits for the previous one's flag, which has long arrived, and
no collective runs on the other steps (on a 2-core machine even gloo's background thread
competes with the step's kernels). Every rank counts the same steps, so the collectives pair up.
When the flag is set, every rank marks
``received_sigterm`` at the same step boundary, and Lightning's own end-of-batch check then
stops all ranks after the same batch. The signal handler only records the signal (and
forwards it to Lightning-launched children, as before).
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch
import torch.distributed as dist

from lightning_ett.patching import Patches

log = logging.getLogger(__name__)


class DeferredSigtermBroadcast:
    def __init__(self, trainer: Any, connector: Any, interval: int = 8) -> None:
        if interval < 1:
            raise ValueError(f"`interval` must be >= 1, got {interval}")
        self.trainer = trainer
        self.interval = interval
        self._calls = 0
        self.connector = connector
        self.requested = False  # rank 0's handler sets it; only the broadcast makes it act
        self._pending: tuple[Any, torch.Tensor] | None = None

    def __call__(self) -> None:
        self._calls += 1
        if self._calls % self.interval:
            return
        self.flush()
        if self.connector.received_sigterm:
            return  # decided: Lightning stops every rank after this batch
        flag = torch.tensor([1 if self.requested else 0])
        self._pending = (dist.broadcast(flag, src=0, async_op=True), flag)

    def flush(self) -> None:
        """Wait for the outstanding flag; if it is set, every rank stops after the current batch."""
        if self._pending is None:
            return
        work, flag = self._pending
        self._pending = None
        work.wait()
        if int(flag[0]) == 1:
            self.connector.received_sigterm = True

    def record_sigterm(self, signum: int, _frame: Any) -> None:
        log.info(f"[rank: {self.trainer.global_rank}] Received SIGTERM: {signum}")
        launcher = self.trainer.strategy.launcher
        if not self.requested and launcher is not None:
            launcher.kill(signum)
        self.requested = True


def install(trainer: Any, patches: Patches) -> DeferredSigtermBroadcast | None:
    """Swap in the deferred check (call once Lightning has registered its signal handlers); ``patches`` undoes it.

    Only where the process group carries CPU tensors (gloo) and this Lightning has the
    per-step broadcast and a SIGTERM handler of the known shape; otherwise Lightning's own
    scheme stays untouched.
    """
    if not (dist.is_available() and dist.is_initialized()) or "gloo" not in str(dist.get_backend()):
        return None
    if dist.get_world_size() < 2:
        return None  # Lightning neither broadcasts nor needs to: its own SIGTERM handling stays
    loop = trainer.fit_loop.epoch_loop
    connector = getattr(trainer, "_signal_connector", None)
    notifier = getattr(connector, "_sigterm_notifier_fn", None)
    handler = signal.getsignal(signal.SIGTERM)
    handlers = getattr(handler, "signal_handlers", None)
    if not hasattr(loop, "_broadcast_sigterm_tensor") or not isinstance(handlers, list) or notifier not in handlers:
        return None
    replacement = DeferredSigtermBroadcast(trainer, connector)
    patches.setattr(handler, "signal_handlers", [replacement.record_sigterm if h == notifier else h for h in handlers])
    patches.setattr(loop, "_broadcast_sigterm_tensor", replacement)
    return replacement
