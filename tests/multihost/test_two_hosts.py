"""`lightning run --num-nodes 2` across two hosts (network namespaces): training, a dead worker, a dead node,
a partition, and the addresses the nodes advertise. Real launchers, real gloo ranks, real SIGKILLs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
from conftest import REPO, clean_env, rank_facts

from lightning_ett import summarize_run_dir
from lightning_ett.checkpoint import layout
from lightning_ett.instrument.ledger import read_launcher_records, read_ledger
from lightning_ett.launch.peers import HEARTBEAT_S, SILENT_S
from tests.multihost.conftest import ETT_JOB, TwoHostJob

EXAMPLE = [str(REPO / "examples" / "dlrm_example.py"), "fit", "--config", str(REPO / "examples" / "dlrm.yaml"),
           "--trainer.devices", "1", "--trainer.num_nodes", "2", "--trainer.max_steps", "24",
           "--trainer.val_check_interval", "12", "--trainer.limit_val_batches", "2"]
#: node 0 says a node is lost within this long of its death: SILENT_S of silence, seen at the next heartbeat (its
#: last beat is seen up to a look late, the silence up to another; a look is a heartbeat period plus its store
#: operations, slower on a loaded host), plus this test's polling of the console.
NOTICE_WITHIN_S = SILENT_S + 2 * HEARTBEAT_S + 3
PARTITION_S = 60.0


def _ett_job(tmp, max_steps: int, step_sleep: float = 0.0) -> list[str]:
    (tmp / "out").mkdir(exist_ok=True)
    return [ETT_JOB, "--out", str(tmp / "out"), "--devices", "1", "--num-nodes", "2", "--max-steps", str(max_steps),
            "--async-every", "5", "--ckpt-dir", str(tmp / "ckpt"), "--ett-from-env", "--step-sleep", str(step_sleep)]


# ---------------------------------------------------------------------------------------------- no false alarms first
def test_a_node_that_starts_late_or_a_short_outage_is_no_lost_node(two_hosts, tmp_path):
    # Node 1 starts 20 s after node 0 (a scheduler), then its link drops for 5 s mid-training: TCP rides it out.
    job = TwoHostJob(two_hosts, tmp_path, _ett_job(tmp_path, 80, 0.1), ["--max-restarts", "0"])
    job.start(0)
    time.sleep(SILENT_S + 5)
    job.start(1)
    job.wait_for_steps(15)
    two_hosts.set_link(1, up=False)
    time.sleep(5)
    two_hosts.set_link(1, up=True)
    assert job.wait(0, 300) == 0, job.output(0)[-4000:]
    assert job.wait(1, 60) == 0, job.output(1)[-4000:]
    s = summarize_run_dir(tmp_path / "run")
    assert len(s.attempts) == 1 and s.completed and s.nodes == [] and s.phases["node_lost"] == 0
    for node in (0, 1):
        assert "stopped responding" not in job.output(node)


def test_the_example_trains_across_two_hosts_with_one_wandb_run_and_one_report(two_hosts, tmp_path):
    job = TwoHostJob(two_hosts, tmp_path, EXAMPLE, ["--max-restarts", "0"]).start_both()
    assert job.wait(0, 300) == 0, job.output(0)[-4000:]
    assert job.wait(1, 60) == 0, job.output(1)[-4000:]

    ledgers = read_ledger(tmp_path / "run")  # each node's ranks wrote into the shared run directory: one job
    assert sorted(lg.rank for lg in ledgers) == [0, 1]
    assert all(lg.status == "finished" and lg.header["world_size"] == 2 for lg in ledgers)
    launches = [r for r in read_launcher_records(tmp_path / "run") if r["kind"] == "launch"]
    assert {r["node_rank"]: r["address"] for r in launches} == {0: two_hosts.address(0), 1: two_hosts.address(1)}
    s = summarize_run_dir(tmp_path / "run")
    assert s.completed and s.attempts[0].last_step == 23 and s.attempts[0].ranks == [0, 1]
    assert "ETT" in job.output(0) and "node 0 prints it" in job.output(1)  # one report, printed by node 0
    # The hostname is loopback on both hosts: each advertised its address on the pair instead, and said so.
    for node in (0, 1):
        assert f"advertising {two_hosts.address(node)}" in job.output(node)
    assert "stopped responding" not in job.output(0) + job.output(1) and s.nodes == []
    runs = list(tmp_path.glob("ett_runs/wandb/offline-run-*"))
    assert len(runs) == 1, runs  # one W&B run for the job (rank 0's)


@pytest.mark.parametrize("two_hosts", ["loopback", "per_host"], indirect=True)
def test_a_worker_killed_on_node_1_restarts_both_nodes_from_the_newest_checkpoint(two_hosts, tmp_path):
    job = TwoHostJob(two_hosts, tmp_path, _ett_job(tmp_path, 20, 0.05), ["--max-restarts", "1"],
                     LIGHTNING_ETT_FAULT_KILL="1:12").start_both()  # rank 1, on node 1, dies after step 12
    assert job.wait(0, 300) == 0, job.output(0)[-4000:]
    assert job.wait(1, 60) == 0, job.output(1)[-4000:]
    s = summarize_run_dir(tmp_path / "run")
    assert [a.completed for a in s.attempts] == [False, True]
    assert "rank 1 killed by SIGKILL (lightning-ett fault injection" in s.attempts[0].failure
    assert s.attempts[1].first_step in (5, 10)  # resumed from a checkpoint both nodes committed
    assert [f["global_step"] for f in rank_facts(tmp_path / "out")] == [20, 20]
    assert "advertising" not in job.output(0) if two_hosts.hostnames == "per_host" else True


@pytest.mark.parametrize("two_hosts, spare", [("loopback", False), ("per_host", True)], indirect=["two_hosts"],
                         ids=["replaced-on-its-host", "replaced-by-another-machine"])
def test_node_1_dies_whole_node_0_says_so_and_a_replacement_finishes_the_job(two_hosts, tmp_path, spare):
    job = TwoHostJob(two_hosts, tmp_path, _ett_job(tmp_path, 60, 0.1), ["--max-restarts", "2"]).start_both()
    job.wait_for_steps(17)  # (between saves, every 5 steps: at 15 the kill often came just after the save's commit)
    killed = time.monotonic()
    two_hosts.kill_host(1)  # every process of node 1: its launcher, its worker
    address = re.escape(two_hosts.address(1))
    job.wait_for_text(0, rf"node 1 \({address}\) stopped responding", timeout=60)
    noticed = time.monotonic() - killed
    assert noticed <= NOTICE_WITHIN_S, noticed
    assert "waiting for it, or a launcher replacing it, to rejoin" in job.output(0)
    # The scheduler's replacement: on the same host, or on another machine (its own hostname) while the dead launcher's
    # lock on node 1's part of the run directory still looks fresh (its heartbeat stopped < 60 s ago).
    job.start(1, spare=spare)
    assert job.wait(0, 300) == 0, job.output(0)[-4000:]
    assert job.wait(1, 60) == 0, job.output(1)[-4000:]

    s = summarize_run_dir(tmp_path / "run")
    assert s.completed and [f["global_step"] for f in rank_facts(tmp_path / "out")] == [60, 60]
    assert s.attempts[0].failure.startswith(f"node 1 ({two_hosts.address(1)}) stopped responding")
    assert [e["kind"] for e in s.nodes] == ["node_lost", "node_back"]
    # The wait is charged to node_lost (from node 1's last heartbeat to the restart), not to launch.
    restart = s.attempts[1].start
    assert s.phases["node_lost"] > 0.8 * (restart - s.nodes[0]["since"]) - 5, s.phases
    # (Not a comparison of phase totals: launch also holds attempt 0's start-up.) Up to the first launcher's start
    # of attempt 1; from there to its ranks' first event is that attempt's own launch.
    since = s.nodes[0]["since"]
    relaunch = min(r["time"] for r in read_launcher_records(tmp_path / "run") if r["kind"] == "attempt" and r["attempt"] == 1)
    for rank, segments in s.segments.items():
        assert not [g for g in segments if g.phase == "launch" and g.end > since and g.start < relaunch], rank
    # Steps after the checkpoint ran twice (lost), unless the checkpoint was committed after the last step trained.
    assert (s.lost_s > 0) == (s.attempts[1].first_step <= s.attempts[0].last_step), (s.lost_s, s.attempts)
    assert "node 1" in (tmp_path / "run" / "ett_summary.json").read_text()
    if spare:
        assert "a peer declared it gone: node 1" in job.output(1)  # it took over node 1's lock, and said so


def test_a_60s_partition_is_noticed_named_and_recovered_by_a_restart(two_hosts, tmp_path):
    # Long enough before the partition for the hang watch to have learned the step's limit (10 s here): the stall
    # then outlasts it. (Earlier, under the unlearned 10-minute limit, the job rides a 60 s outage out in place.)
    job = TwoHostJob(two_hosts, tmp_path, _ett_job(tmp_path, 120, 0.1), ["--max-restarts", "2"]).start_both()
    job.wait_for_steps(60)
    two_hosts.set_link(1, up=False)
    down = time.monotonic()
    address = re.escape(two_hosts.address(1))
    noticed = job.wait_for_text(0, rf"node 1 \({address}\) stopped responding", timeout=60)
    assert noticed <= NOTICE_WITHIN_S, noticed
    # node 0's ranks are stalled (the hang watch's learned limit) while node 1 is silent: stopped, naming node 1
    job.wait_for_text(0, r"attempt 0 stopped: node 1", timeout=60)
    committed_before = {e.step for e in layout.committed(tmp_path / "ckpt")}  # nothing commits without node 1 now
    time.sleep(max(0.0, PARTITION_S - (time.monotonic() - down)))
    two_hosts.set_link(1, up=True)
    # Node 1's ranks end either way once the link is back: stopped on node 0's word, or failing on the resets of
    # node 0's stopped ranks, whichever comes first.
    assert job.wait(0, 300) == 0, job.output(0)[-4000:]
    assert job.wait(1, 60) == 0, job.output(1)[-4000:]

    s = summarize_run_dir(tmp_path / "run")
    assert s.completed and len(s.attempts) == 2
    assert [f["global_step"] for f in rank_facts(tmp_path / "out")] == [120, 120]
    assert f"node 1 ({two_hosts.address(1)}) stopped responding" in s.attempts[0].failure
    assert s.phases["node_lost"] > 40, s.phases
    # Every checkpoint left is complete, and the restart resumed from one committed before the partition or after it,
    # never from a mix: a save cut by the partition has no manifest and is not a checkpoint.
    for entry in layout.committed(tmp_path / "ckpt"):
        assert layout.verify(entry.path) is None, entry
    assert s.attempts[1].first_step in committed_before | {0}


# ---------------------------------------------------------------------------------------------- addresses
ALLREDUCE = str(REPO / "tests" / "scripts" / "allreduce_job.py")


def _allreduce(tmp_path) -> list[str]:
    (tmp_path / "out").mkdir(exist_ok=True)
    return [ALLREDUCE, str(tmp_path / "out")]


@pytest.mark.parametrize("two_hosts", ["loopback", "per_host"], indirect=True)
def test_workers_get_a_store_address_and_a_gloo_interface_the_other_host_can_reach(two_hosts, tmp_path):
    job = TwoHostJob(two_hosts, tmp_path, _allreduce(tmp_path), ["--max-restarts", "0", "--no-hang-watch"]).start_both()
    assert job.wait(0, 120) == 0, job.output(0)[-4000:]
    assert job.wait(1, 60) == 0, job.output(1)[-4000:]
    facts = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [f["sum"] for f in facts] == [3.0, 3.0]
    # The rendezvous, not --node-rank, decides which host runs rank 0 (and its store).
    host = {f["rank"]: next(h for h in (0, 1) if two_hosts.links[h] in f["interfaces"]) for f in facts}
    assert sorted(host.values()) == [0, 1]
    # The host of rank 0 advertised what the other can reach: its address where its hostname is loopback, else its name.
    first = host[0]
    expected = two_hosts.address(first) if two_hosts.hostnames == "loopback" else two_hosts.hostname(first)
    assert facts[1]["master_addr"] == expected
    for f in facts:  # where the hostname is loopback, gloo uses the interface on the route to the other host
        expected_ifname = two_hosts.links[host[f["rank"]]] if two_hosts.hostnames == "loopback" else None
        assert f["gloo_socket_ifname"] == expected_ifname  # (a hostname that resolves well keeps gloo's own choice)


def test_a_user_set_gloo_interface_is_left_alone(two_hosts, tmp_path):
    job = TwoHostJob(two_hosts, tmp_path, _allreduce(tmp_path), ["--max-restarts", "0", "--no-hang-watch"],
                     GLOO_SOCKET_IFNAME="eth_users_choice").start_both()
    assert job.wait(0, 120) != 0  # gloo was told an interface these hosts do not have, and says so
    assert "eth_users_choice" in job.output(0) + job.output(1)


def test_a_store_address_that_is_loopback_on_another_host_fails_there_at_once_naming_it_and_the_fix(two_hosts, tmp_path):
    # Each node advertises loopback (what a hostname that /etc/hosts maps to 127.0.0.1 amounts to): whichever runs
    # rank 0, the other host's worker is given a store address that is its own loopback.
    job = TwoHostJob(two_hosts, tmp_path, _allreduce(tmp_path), ["--max-restarts", "3", "--no-hang-watch",
                                                                  "--local-addr", "127.0.0.1"]).start_both()
    started = time.monotonic()
    while all(p.poll() is None for p in (job.procs[0][-1], job.procs[1][-1])) and time.monotonic() - started < 120:
        time.sleep(0.2)
    assert time.monotonic() - started < 60  # seconds, not the process group's 30 minutes
    out = job.output(0) + job.output(1)
    assert "StoreUnreachableError: the store address MASTER_ADDR='127.0.0.1' is loopback on this host" in out, out[-3000:]
    assert "--local-addr" in out
    assert "not retried" in out  # a wrong address fails the same way on every attempt


@pytest.mark.parametrize("master_addr, fails", [("10.99.0.1", True), ("address0", False)])
def test_a_worker_that_cannot_reach_its_store_fails_within_the_stated_time(two_hosts, tmp_path, master_addr, fails):
    address = two_hosts.address(0) if master_addr == "address0" else master_addr  # no route to 10.99/16 from host 1
    code = ("import os, time; from lightning_ett.launch.network import check_store_reachable, StoreUnreachableError\n"
            "t = time.monotonic()\n"
            "try:\n    check_store_reachable(timeout_s=3)\n    print('reached', round(time.monotonic() - t, 1))\n"
            "except StoreUnreachableError as e:\n    print('failed', round(time.monotonic() - t, 1), e.retryable, e)\n")
    env = {**clean_env(), "MASTER_ADDR": address, "MASTER_PORT": "29999", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}
    done = subprocess.run(two_hosts.command(1, [sys.executable, "-c", code]), env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    words = done.stdout.split()
    if fails:  # no route: retried until the deadline, then a retryable failure naming the address
        assert words[0] == "failed" and 3 <= float(words[1]) < 10 and words[2] == "True", done.stdout + done.stderr
        assert f"{address}:29999" in done.stdout
    else:  # the host answers (nothing listens there yet): rank 0 may still be starting, so no failure
        assert words[0] == "reached" and float(words[1]) < 3, done.stdout + done.stderr
