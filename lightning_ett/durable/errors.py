"""Say what went wrong with a write in words a user can act on.

Two libraries hide the cause: ``torch.save`` reports a full disk as
``[enforce fail at inline_container.cc] . unexpected pos N vs M`` (the ``errno`` is lost in
C++), and DCP wraps every rank's error in a ``CheckpointException`` whose text is a
traceback. :func:`explain` unwraps both and names the path.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

#: Below this many free bytes a failed write is taken to be a full disk.
_FULL_DISK_BYTES = 4 << 20
_TORCH_WRITE_FAILURE = ("unexpected pos", "PytorchStreamWriter failed", "inline_container")


class ExplainedError(RuntimeError):
    """An error whose message already says what went wrong in the user's terms: :func:`explain` keeps it."""


#: Ends every error a rank raises only because another rank failed: the launcher names that other rank's error.
ANOTHER_RANKS_ERROR = "on another rank; see its error"


def follows_another_rank(reason: str) -> bool:
    """Is this failure only the echo of another rank's (an agreement raised on every rank)?"""
    return ANOTHER_RANKS_ERROR in reason


def root_cause(error: BaseException) -> BaseException:
    """The innermost error: through DCP's ``CheckpointException`` and ``raise ... from`` chains."""
    seen: set[int] = set()
    while id(error) not in seen and not isinstance(error, ExplainedError):
        seen.add(id(error))
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict) and failures:
            first = next(iter(failures.values()))
            if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
                error = first[0]
                continue
        if isinstance(error, OSError):
            return error
        inner = error.__cause__  # explicit chaining only: a handler's own error is not caused by what it handled
        if inner is None:
            return error
        error = inner
    return error


def _free_bytes(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def explain(error: BaseException, path: str | os.PathLike | None = None) -> str:
    """One line: what failed and where, e.g. ``No space left on device (ENOSPC) writing '/ckpt/step-12.tmp'``."""
    cause = root_cause(error)
    where = f" writing {str(path)!r}" if path is not None else ""
    if isinstance(cause, OSError) and cause.errno is not None:
        name = errno.errorcode.get(cause.errno, str(cause.errno))
        target = cause.filename or path
        at = f" at {str(target)!r}" if target is not None else ""
        return f"{os.strerror(cause.errno)} ({name}){at}"
    text = str(cause).strip().splitlines()
    first = text[0] if text else ""
    if path is not None and any(marker in str(cause) for marker in _TORCH_WRITE_FAILURE):
        free = _free_bytes(Path(path))
        if free is not None and free < _FULL_DISK_BYTES:
            return f"No space left on device (ENOSPC){where}: {free} bytes free on its filesystem"
    return f"{type(cause).__name__}: {first[:500]}{where}"


class ConfigurationError(ValueError):
    """A setting that cannot work, with the argument and the fix named.

    It fails the same way on every attempt, so ``lightning run`` ends the job at the first one
    instead of retrying it ``--max-restarts`` times.
    """


class IncompleteCheckpointError(FileNotFoundError, ConfigurationError):
    """A checkpoint named explicitly (``ckpt_path``) that is not complete: missing, unfinished, or its chain's base
    gone. A FileNotFoundError as before; not retried, as the same files fail the same way on every attempt."""


def check_full_every(owner: str, name: str, value: object, switch: str, switched_on: bool, what: str) -> None:
    """Validate a "full every N" argument that only applies with its switch (``AsyncCheckpoint(incremental=True)``,
    ``ModelPublisher(deltas=True)``): ``None``, or an int >= 1 given together with the switch."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(f"{owner}({name}={value!r}): expected an int >= 1 (1: every one full), or None to start "
                                 f"a new full {what} by the chain's measured size.")
    if not switched_on:
        raise ConfigurationError(f"{owner}({name}={value!r}) applies only with {switch}=True: pass {switch}=True too, "
                                 "or drop it.")


class ConfigurationTypeError(ConfigurationError, TypeError):
    """A :class:`ConfigurationError` about an argument's type (still a ``TypeError`` to those who catch one)."""


#: Set on an error by a component that chose the checkpoint being loaded (AsyncCheckpoint's resume): not the user's
#: ``ckpt_path``, so the launcher retries it (another node's storage may not show it yet).
CHOSEN_CHECKPOINT_ATTR = "lightning_ett_chosen_checkpoint"
