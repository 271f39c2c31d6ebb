"""The directory lock a callback takes on rank 0 (callbacks/directory_owner.py): its agreement's failure paths."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from lightning_ett.callbacks.directory_owner import own_directory
from lightning_ett.durable.ownership import PUBLISHER_OWNER_FILE


class _Strategy:
    root_device = "cpu"

    def __init__(self, reduce_fails: bool) -> None:
        self.reduce_fails = reduce_fails

    def reduce(self, tensor, reduce_op):  # type: ignore[no-untyped-def]
        if self.reduce_fails:
            raise RuntimeError("a peer is gone")
        return tensor

    def broadcast(self, obj, src=0):  # type: ignore[no-untyped-def]
        return obj


def _rank0(world_size: int, reduce_fails: bool = False) -> types.SimpleNamespace:
    return types.SimpleNamespace(is_global_zero=True, world_size=world_size, strategy=_Strategy(reduce_fails))


def test_a_lock_taken_before_the_agreement_failed_is_released_so_the_next_fit_takes_it(tmp_path: Path):
    # Rank 0 took the lock, then the collective that tells the other ranks failed: nothing holds the lock to
    # release it later, so a second fit in this process (a notebook, a sweep) would be refused by its own job.
    with pytest.raises(RuntimeError, match="a peer is gone"):
        own_directory(_rank0(2, reduce_fails=True), tmp_path, PUBLISHER_OWNER_FILE, "ModelPublisher", fix="",
                      on_takeover=print)
    assert not (tmp_path / PUBLISHER_OWNER_FILE).exists()
    lock = own_directory(_rank0(1), tmp_path, PUBLISHER_OWNER_FILE, "ModelPublisher", fix="", on_takeover=print)
    assert lock is not None and (tmp_path / PUBLISHER_OWNER_FILE).exists()
    assert own_directory(_rank0(1), tmp_path, PUBLISHER_OWNER_FILE, "ModelPublisher", fix="", on_takeover=print,
                         held=lock) is lock  # held already: kept, not taken again
    lock.release()
    assert not (tmp_path / PUBLISHER_OWNER_FILE).exists()
