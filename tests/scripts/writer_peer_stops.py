"""Two gloo ranks save one checkpoint with AsyncCheckpoint's writer; rank 1 stops after the ranks agreed that every
part is written (where rank 0's commit would be confirmed to it), while rank 0 is held before its commit
(``LIGHTNING_ETT_FAULT_WRITE_DELAY_S``). Rank 0 writes what its ``wait`` raised, and the newest complete checkpoint
it finds, as JSON to OUT.

    python writer_peer_stops.py ROOT OUT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class StopAtConfirmation:
    """``torch.distributed`` for the writer module of rank 1, except that the commit's confirmation ends the process."""

    def broadcast_object_list(self, *args: object, **kwargs: object) -> None:
        os._exit(0)

    def __getattr__(self, name: str) -> object:
        return getattr(dist, name)


def rank_main(rank: int, root: Path, out: Path, port: int) -> None:
    import lightning_ett.checkpoint.writer as writer_module
    from lightning_ett.checkpoint.layout import newest_complete
    from lightning_ett.checkpoint.staging import Stager
    from lightning_ett.checkpoint.writer import CheckpointWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["LIGHTNING_ETT_FAULT_WRITE_DELAY_S"] = "2" if rank == 0 else "0"  # rank 1 is gone when rank 0 commits
    dist.init_process_group("gloo", rank=rank, world_size=2)
    stager, writer = Stager(), CheckpointWriter(root, rank, True, dist.group.WORLD, None)
    state = {"dcp": {"model": {"w": torch.arange(8.0)}}, "meta": {"global_step": 5}}
    snapshot = stager.stage(state, set(), keep_base=False, as_delta=False)
    if rank == 1:  # rank 1 stops where rank 0's commit is confirmed: after the ranks agreed every part is written
        writer_module.dist = StopAtConfirmation()
    writer.submit(snapshot, 5)
    snapshot.settle()
    if rank == 1:
        time.sleep(600)  # (it exits in the writer thread)
    try:
        writer.wait()
        said = None
    except Exception as e:  # noqa: BLE001 - what a user would read
        said = f"{type(e).__name__}: {e}"
    found = newest_complete(root)
    out.write_text(json.dumps({"error": said, "newest_complete": str(found) if found else None}))
    os._exit(0)  # the group has a dead member: no teardown


if __name__ == "__main__":
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    mp.spawn(rank_main, args=(Path(sys.argv[1]), Path(sys.argv[2]), find_free_network_port()), nprocs=2, join=True)
