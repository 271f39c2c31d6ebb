"""One live job per directory a callback writes: rank 0 takes the directory's lock, and every rank learns the outcome.

Shared by ``AsyncCheckpoint`` (its ``dirpath``) and ``ModelPublisher`` (its publish directory): two jobs
writing one directory would resume from, overwrite or interleave each other's files. The lock itself is
:class:`lightning_ett.durable.ownership.OwnerLock`; what is here is the agreement: only rank 0 takes it,
so whatever fails there (the lock, the job context) is raised on every rank — a lone raise would leave
the other ranks waiting in the next collective (a hang under NCCL).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl

from lightning_ett.callbacks.collectives import raise_on_every_rank
from lightning_ett.durable.errors import explain
from lightning_ett.durable.ownership import DirectoryInUseError, OwnerLock
from lightning_ett.instrument.environment import resolve_job_context


def own_directory(trainer: pl.Trainer, dirpath: Path, lock_name: str, owner: str, fix: str,
                  on_takeover: Callable[[str], None], held: OwnerLock | None = None) -> OwnerLock | None:
    """Rank 0 takes ``dirpath/lock_name`` for this job (returned there; ``None`` elsewhere), or every rank raises.

    ``owner`` names the callback and argument in the messages (``"AsyncCheckpoint"``); ``fix`` ends a refusal.
    This job's previous attempt is taken over quietly; another job's stale lock, through ``on_takeover``.
    ``held``: the lock rank 0 holds already (returned as is). Every rank calls this, whatever rank 0 holds: the
    agreement below is collective.
    """
    refusal: str | None = None
    failure: Exception | None = None
    lock: OwnerLock | None = held
    where = f"dirpath={str(dirpath)!r}"
    if trainer.is_global_zero and held is None:
        try:
            job = resolve_job_context(export=False)
            lock = OwnerLock(dirpath, lock_name, job.job_id, job.attempt, what=f"{owner}({where})", fix=fix,
                             earlier_attempts_are_stopped=True, on_takeover=on_takeover)
            lock.acquire()
        except DirectoryInUseError as err:
            refusal = str(err)
        except OSError as err:
            if err.errno is None:  # (a message alone: nothing to name)
                failure = OSError(f"{owner}: taking the lock of {where} failed: {explain(err)}")
            else:  # named at the lock: the error may name the temporary file renamed onto it, gone by now
                at_lock = OSError(err.errno, err.strerror, str(dirpath / lock_name))
                failure = OSError(err.errno, f"{owner}: taking the lock of {where} failed: {explain(at_lock)}")
            failure.__cause__ = err
        except Exception as err:  # noqa: BLE001 - raised on every rank just below
            failure = err
    try:
        raise_on_every_rank(trainer, failure, owner, "taking its dirpath's lock failed")
        refusal = trainer.strategy.broadcast(refusal, src=0)
    except BaseException:
        if lock is not None and lock is not held:  # taken here, never handed out: nothing else would release it
            lock.release()
        raise
    if refusal:
        raise DirectoryInUseError(refusal)
    return lock
