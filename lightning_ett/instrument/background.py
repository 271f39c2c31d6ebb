"""Run one start-up task in a background thread while the main thread does other start-up work.

Used for the process group (ETTStrategy) and the loggers' start-up (ETTMonitor). The task's
span is recorded as its phase when it is joined; everything the thread raises is re-raised on
the main thread by :meth:`BackgroundTask.join`, with the original traceback chained.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from lightning_ett.instrument.timeline import Phase, get_timeline


class BackgroundTask:
    """A thread running ``fn`` and recording its span as ``phase`` on the ETT timeline."""

    def __init__(self, fn: Callable[[], Any], phase: Phase, name: str) -> None:
        self._fn = fn
        self._phase = phase
        self._error: BaseException | None = None
        self._result: Any = None
        self.start_time = time.time()
        self.end_time: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread by join()
            self._error = err
        finally:
            self.end_time = time.time()

    def join(self, timeout: float | None = None) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._thread.name} did not finish within {timeout} s")
        assert self.end_time is not None
        get_timeline().record(self._phase, self.start_time, self.end_time)
        if self._error is not None:
            raise RuntimeError(f"{self._phase.value} failed in the background: {self._error}") from self._error
        return self._result
