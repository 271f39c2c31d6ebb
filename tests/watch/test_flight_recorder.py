"""The flight recorder read from outside two real gloo ranks: which collective each enqueued and completed."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import clean_env

from lightning_ett.instrument.environment import launch_scratch_dir
from lightning_ett.watch import flight_recorder
from lightning_ett.watch.flight_recorder import Collectives, GroupStatus, behind

# Two ranks forked after torch's import: both serve dumps; three all-reduces; then rank 1 stops making calls
# (a hang in Python) while rank 0 waits in a fourth all-reduce.
PAIR = """
import os, sys, time
import torch, torch.distributed as dist
from lightning_ett.watch import flight_recorder
out, port = sys.argv[1], sys.argv[2]
for rank in (0, 1):
    if os.fork() == 0:
        break
else:
    os.wait(); os.wait(); sys.exit(0)
flight_recorder.serve(rank)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
open(os.path.join(out, f"ready{rank}"), "w").close()
if rank == 1:
    while True:
        time.sleep(3600)
dist.all_reduce(t)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_never_enqueued_the_collective_its_peer_waits_for_is_named(tmp_path: Path):
    token = f"test{os.getpid()}"
    env = clean_env(LIGHTNING_ETT_LAUNCH_TOKEN=token, LIGHTNING_ETT_ATTEMPT="3")
    pair = subprocess.Popen([sys.executable, "-c", PAIR, str(tmp_path), str(_free_port())], env=env,
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)) and time.time() < deadline:
            assert pair.poll() is None
            time.sleep(0.1)
        statuses = flight_recorder.request(token, 3, [0, 1, 2])
        while not (statuses[0] is not None and statuses[0].waiting) and time.time() < deadline:
            time.sleep(0.2)  # until rank 0 is in its fourth all-reduce (a loaded host takes a while to get there)
            statuses = flight_recorder.request(token, 3, [0, 1, 2])
        assert statuses[2] is None  # no such rank serves: no answer, no wait beyond the timeout
        s0, s1 = statuses[0], statuses[1]
        assert s0 is not None and s1 is not None
        (key,) = s0.groups  # the default group, keyed alike on both ranks
        assert s0.groups[key] == GroupStatus(4, 3, "gloo:all_reduce") and s0.waiting  # waiting in which operation
        assert s1.groups[key] == GroupStatus(3, 3) and not s1.waiting
        named = behind({0: s0, 1: s1})
        assert named is not None and named[0] == 1 and "wait for collective #4, which rank 1 has not enqueued" in named[1]
        assert flight_recorder.request(token, 3, [0])[0] == s0  # asked again: answered again (the thread serves on)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pair.pid, signal.SIGKILL)
        pair.wait()
        shutil.rmtree(launch_scratch_dir(token), ignore_errors=True)
    assert not flight_recorder.dump_dir(token, 3).exists()


def test_progress_and_a_deadlock_across_groups():
    before = Collectives({"gloo/0": GroupStatus(5, 4)})
    assert Collectives({"gloo/0": GroupStatus(6, 5)}).completed_since(before)
    assert not Collectives({"gloo/0": GroupStatus(6, 4)}).completed_since(before)
    cycle = {0: Collectives({"gloo/0": GroupStatus(31, 30), "gloo/1": GroupStatus(4, 4)}),
             1: Collectives({"gloo/0": GroupStatus(30, 30), "gloo/1": GroupStatus(5, 4)})}
    assert behind(cycle) is None  # each waits in a group the other never joins: not one rank to name
    stuck = {0: Collectives({"gloo/0": GroupStatus(31, 30)}), 1: Collectives({"gloo/0": GroupStatus(31, 30)})}
    assert behind(stuck) is None  # both enqueued it, neither completed it: a collective that never completes
    assert flight_recorder.parse_status({"groups": {"gloo/0": {"enqueued": 2}}}).groups == {}


def test_groups_are_matched_by_name_across_ranks_not_by_torchs_process_local_uid():
    # What torch dumps when rank 1 is outside group "1" ([0] only): group "2" ([0, 1]) is uid 2 on rank 0, uid 1 on
    # rank 1; gloo's and NCCL's recorders number their groups independently.
    def dump(uids: dict[int, str], status: dict[int, tuple[int, int]]) -> dict:
        return {"entries": [{"pg_id": uid, "process_group": (name, "undefined")} for uid, name in uids.items()],
                "pg_status": {str(uid): {"last_enqueued_collective": e, "last_started_collective": -1,
                                         "last_completed_collective": c} for uid, (e, c) in status.items()}}

    r0 = flight_recorder.group_statuses("gloo", dump({0: "0", 1: "1", 2: "2"}, {0: (9, 9), 1: (3, 3), 2: (5, 4)}))
    r1 = flight_recorder.group_statuses("gloo", dump({0: "0", 1: "2"}, {0: (9, 9), 1: (4, 4), 3: (7, 7)}))
    assert r0 == {"gloo/0": {"enqueued": 9, "completed": 9}, "gloo/1": {"enqueued": 3, "completed": 3},
                  "gloo/2": {"enqueued": 5, "completed": 4}}
    assert r1 == {"gloo/0": {"enqueued": 9, "completed": 9}, "gloo/2": {"enqueued": 4, "completed": 4}}  # uid 3: no entry
    assert flight_recorder.group_statuses("nccl", dump({1: "0"}, {1: (2, 1)})) == {"nccl/0": {"enqueued": 2, "completed": 1}}
    named = behind({0: flight_recorder.parse_status({"groups": r0}), 1: flight_recorder.parse_status({"groups": r1})})
    assert named is not None and named[0] == 1 and "in process group gloo/2" in named[1]
