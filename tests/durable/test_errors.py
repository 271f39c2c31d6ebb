"""Errors a user can act on: the OS's words and the path, not a traceback object."""

from __future__ import annotations

import errno
import traceback

from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from lightning_ett.durable.errors import ExplainedError, explain


def _dcp_failure(error: BaseException) -> CheckpointException:
    try:
        raise error
    except BaseException as e:  # noqa: BLE001
        return CheckpointException("save failed", {0: _wrap_exception(e)})


def test_a_full_disk_inside_dcps_wrapper_says_so_with_the_path():
    wrapped = _dcp_failure(OSError(errno.ENOSPC, "No space left on device", "/ckpt/step-000000012.tmp/__0_0.distcp"))
    assert "FrameSummary" in repr(wrapped)  # what the report used to print
    said = explain(wrapped)
    assert said == "No space left on device (ENOSPC) at '/ckpt/step-000000012.tmp/__0_0.distcp'"


def test_other_errors_give_their_type_and_first_line_not_a_traceback():
    said = explain(_dcp_failure(RuntimeError("bad shard\nmore detail")), "/ckpt/step-1.tmp")
    assert said == "RuntimeError: bad shard writing '/ckpt/step-1.tmp'"
    assert "Traceback" not in explain(_dcp_failure(ValueError("x"))) and "FrameSummary" not in said


def test_a_chained_os_error_is_found_and_an_explained_error_is_kept():
    try:
        try:
            raise PermissionError(errno.EACCES, "Permission denied", "/ckpt")
        except OSError as inner:
            raise RuntimeError("commit failed") from inner
    except RuntimeError as outer:
        assert explain(outer) == "Permission denied (EACCES) at '/ckpt'"
    kept = ExplainedError("The background checkpoint write failed: No space left on device (ENOSPC) at '/ckpt'")
    assert explain(kept) == f"ExplainedError: {kept}"
    assert traceback.format_exception_only(type(kept), kept)  # an ordinary exception otherwise
