from __future__ import annotations

import time

import pytest

from lightning_ett.instrument.background import BackgroundTask
from lightning_ett.instrument.timeline import Phase


def test_background_task_returns_and_records_its_span(isolated_job):
    task = BackgroundTask(lambda: time.sleep(0.05) or 42, Phase.PROCESS_GROUP_INIT, name="test")
    assert task.join() == 42
    assert isolated_job.exclusive_s["process_group_init"] >= 0.05


def test_an_error_in_the_background_thread_is_raised_on_the_caller(isolated_job):
    def fail() -> None:
        raise ConnectionError("rendezvous at 10.0.0.1:29500 refused")

    task = BackgroundTask(fail, Phase.PROCESS_GROUP_INIT, name="test")
    with pytest.raises(RuntimeError, match="process_group_init failed in the background: rendezvous") as info:
        task.join()
    assert isinstance(info.value.__cause__, ConnectionError)
    assert "process_group_init" in isolated_job.exclusive_s  # the failed span is still on the timeline
