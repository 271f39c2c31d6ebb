"""One W&B service per node, owned by ``lightning run``, for every attempt of the job.

Why: ``wandb.init`` in a worker starts that worker's own service process (``wandb-core``),
which writes the run's records and is stopped when the worker dies. A SIGKILLed rank took with
it every record the service had not written yet: an offline run of a 2 s attempt kept none.
Each restart also paid the service's start again. A service that the launcher starts outlives
the workers, so what a killed rank had logged is still written, and a worker's
``wandb.init`` connects to it in about 0.3 s instead of starting one (0.5 s here). This is W&B's
documented way for multiprocessing: ``wandb.setup()`` in the parent, and the children find
the service through ``WANDB_SERVICE``.

The service is started in a background thread while the launcher does its own start-up, and
only for a job whose script (or a config file among its arguments) mentions W&B. After a failed
attempt it is stopped and started anew (0.2 s, while the agent stops the old workers and
rendezvouses again): stopping it writes and closes the dead workers' runs, whose ids the next
attempt resumes (W&B refuses an id still open in the service).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Where W&B's children look for a running service.
ENV_WANDB_SERVICE = "WANDB_SERVICE"


class WandbService:
    """Starts W&B's service in the background; hands its address to each attempt's workers."""

    def __init__(self) -> None:
        self._env: dict[str, str] = {}  # the running service's address; empty when none runs
        self._thread = self._in_background(self._start)

    @staticmethod
    def _in_background(target: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=target, name="ett-wandb-service", daemon=True)
        thread.start()
        return thread

    def restart(self) -> None:
        """After a failed attempt: close its runs (stop the service), then start a fresh service."""
        self._thread.join(60.0)
        self._thread = self._in_background(self._restart)

    def _restart(self) -> None:
        self._stop()
        self._start()

    def _start(self) -> None:
        try:
            import wandb

            wandb.setup()
        except Exception as err:  # noqa: BLE001 - without it, each worker starts its own service, as before
            log.warning("lightning run: could not start a W&B service for the job (%r); each worker will start its "
                        "own.", err)
            return
        address = os.environ.get(ENV_WANDB_SERVICE)
        if address:
            self._env = {ENV_WANDB_SERVICE: address}

    def worker_env(self, timeout: float = 60.0) -> dict[str, str]:
        """``WANDB_SERVICE`` for the workers (empty if the service did not start in time)."""
        self._thread.join(timeout)
        return dict(self._env) if not self._thread.is_alive() else {}

    def stop(self) -> None:
        """Let the service write what it holds and exit (part of the job's end)."""
        self._thread.join(60.0)
        self._stop()

    def _stop(self) -> None:
        if self._env:
            import wandb

            wandb.teardown()
            self._env = {}
