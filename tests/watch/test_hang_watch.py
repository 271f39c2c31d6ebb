"""The hang watch's decisions: progress from ledger records, per-phase limits, blame, stack dumps."""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_ett.instrument.ledger import RankLedger
from lightning_ett.instrument.summary import summarize
from lightning_ett.launch.hang_response import HangOptions, HangWatch, stop_processes
from lightning_ett.watch.hang import HangTimeouts, blame, find_stall
from lightning_ett.watch.progress import LedgerTail, RankProgress
from lightning_ett.watch.stacks import DUMP_SIGNAL, parse_dump


def trained(rank: int, steps: int, step_s: float = 0.1, t0: float = 1000.0) -> RankProgress:
    p = RankProgress(rank, last_progress=t0)
    for s in range(steps):
        p.update({"kind": "begin", "phase": "train", "step": s, "time": t0 + s * step_s})
        p.update({"kind": "event", "phase": "train", "step": s, "start": t0 + s * step_s, "end": t0 + (s + 1) * step_s})
    return p


def test_the_training_limit_is_a_multiple_of_the_median_step_with_a_floor_and_startup_before_enough_steps():
    t = HangTimeouts(train=5.0, step_factor=10.0, min_steps=5, startup=100.0)
    assert t.limit(trained(0, 3)) == 100.0  # too few steps measured: the first steps are slow by nature
    assert t.limit(trained(0, 20, step_s=0.1)) == 5.0  # 10 x 0.1 s is under the floor
    assert t.limit(trained(0, 20, step_s=2.0)) == pytest.approx(20.0)
    slow = trained(0, 20)
    slow.update({"kind": "begin", "phase": "compile", "time": 1003.0})
    assert slow.phase == "compile" and t.limit(slow) == t.compile
    slow.update({"kind": "event", "phase": "compile", "start": 1003.0, "end": 1010.0})
    assert slow.phase == "train" and slow.last_progress == 1010.0
    slow.update({"kind": "begin", "phase": "eval", "time": 1011.0})
    slow.update({"kind": "begin", "phase": "checkpoint_save", "time": 1012.0})
    slow.update({"kind": "event", "phase": "checkpoint_save", "start": 1012.0, "end": 1013.0})
    assert slow.phase == "eval"  # still inside the evaluation that contains the save
    slow.update({"kind": "status", "status": "finished", "time": 1020.0})
    assert slow.phase == "shutdown" and t.limit(slow) == t.shutdown


def test_a_stall_is_the_rank_furthest_beyond_its_limit():
    t = HangTimeouts(train=1.0, min_steps=1)
    ranks = {0: trained(0, 10), 1: trained(1, 10)}
    now = ranks[0].last_progress + 0.5
    assert find_stall(ranks, t, now) is None
    ranks[1].last_progress -= 3
    stall = find_stall(ranks, t, ranks[0].last_progress + 1.5)
    assert stall is not None and stall.rank == 1 and stall.phase == "train" and stall.limit_s == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True])
def test_timeouts_must_be_positive(bad):
    with pytest.raises(ValueError, match="train"):
        HangTimeouts(train=bad)


DUMP_PY = """
import faulthandler, signal, sys, threading, time
faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
def stuck_in_loader():
    print("ready", flush=True)
    time.sleep(60)
stuck_in_loader()
"""


def test_a_rank_dumps_every_thread_on_the_signal_and_the_main_thread_is_found(tmp_path: Path):
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", DUMP_PY], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, DUMP_SIGNAL)
        deadline = time.monotonic() + 10
        while "stuck_in_loader" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        dump = parse_dump(log.read_text())
    finally:
        stop_processes([proc.pid], grace_s=0.5)
        proc.wait()
    assert dump is not None and dump.threads == 2
    assert str(dump.culprit_frame()).endswith("in stuck_in_loader") and not dump.in_collective


def dump_text(*frames: tuple[str, int, str]) -> str:
    lines = ["Current thread 0x00007f (most recent call first):"]
    lines += [f'  File "{f}", line {n} in {fn}' for f, n, fn in frames]
    return "\n".join(lines + ['  File "/x/site-packages/lightning/pytorch/trainer/trainer.py", line 1 in fit'])


IN_BARRIER = parse_dump(dump_text(("/x/site-packages/torch/distributed/distributed_c10d.py", 5356, "barrier")))
IN_LOADER = parse_dump(dump_text(("/x/site-packages/torch/utils/data/dataloader.py", 88, "__next__")))


def test_blame_prefers_progress_then_stacks_and_says_when_it_is_ambiguous():
    behind, ahead = trained(1, 30), trained(0, 30)
    ahead.update({"kind": "begin", "phase": "train", "step": 30, "time": 1003.1})
    b = blame({0: ahead, 1: behind}, {0: IN_LOADER, 1: IN_BARRIER})  # progress outranks stacks
    assert (b.rank, b.ambiguous) == (1, False) and "before step 30" in b.evidence
    # Same step, but rank 0 began a checkpoint save that rank 1 never reached: rank 1 is behind.
    a0, a1 = trained(0, 30), trained(1, 30)
    a0.update({"kind": "begin", "phase": "checkpoint_save", "step": 30, "time": 1003.05})
    assert blame({0: a0, 1: a1}, {}).rank == 1
    # Level ranks: the one outside any collective is the one the others wait for.
    r0, r1, r2 = trained(0, 30), trained(1, 30), trained(2, 30)
    b = blame({0: r0, 1: r1, 2: r2}, {0: IN_BARRIER, 1: IN_BARRIER, 2: IN_LOADER})
    assert (b.rank, b.ambiguous) == (2, False) and "dataloader.py:88 in __next__" not in b.evidence
    # Nothing tells them apart: the first to go silent is named, and the verdict says it is a guess.
    r1.last_progress -= 1
    b = blame({0: r0, 1: r1}, {0: IN_BARRIER, 1: IN_BARRIER})
    assert (b.rank, b.ambiguous) == (1, True) and "another node" in b.evidence
    # Clock skew cannot move the blame when progress decides it.
    skewed = trained(1, 30, t0=-5000.0)
    assert blame({0: ahead, 1: skewed}, {}).rank == 1


def test_ledger_tail_reads_appended_records_and_waits_for_a_torn_line(tmp_path: Path):
    path = tmp_path / "rank.jsonl"
    tail = LedgerTail(path)
    assert tail.read() == []
    with open(path, "ab") as f:
        f.write(b'{"kind":"begin","phase":"train","step":0,"time":1}\n{"kind":"ev')
    assert [r["kind"] for r in tail.read()] == ["begin"]
    with open(path, "ab") as f:
        f.write(b'ent","phase":"train","step":0,"start":1,"end":2}\n')
    assert [r["kind"] for r in tail.read()] == ["event"]


def test_the_watch_reads_ledgers_and_stops_a_silent_process(tmp_path: Path):
    ledger = tmp_path / "ledger" / "attempt-0000" / "rank-00000.jsonl"
    ledger.parent.mkdir(parents=True)
    now = time.time()
    records = [{"kind": "header", "pid": 0}]
    for s in range(6):
        records.append({"kind": "event", "phase": "train", "step": s, "start": now - 10 + s * 0.01,
                        "end": now - 10 + (s + 1) * 0.01})
    ledger.write_text("".join(json.dumps(r) + "\n" for r in records))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = HangWatch(tmp_path, HangOptions(HangTimeouts(train=1.0), grace_s=0.2))
        watch.attempt_started(0, now - 11)
        verdict = watch.poll({0: (sleeper.pid, None)})
        assert verdict is not None
        assert sleeper.wait(timeout=5) != 0
    finally:
        sleeper.kill()
    assert verdict.rank == 0 and verdict.step == 6 and verdict.reason.startswith("hung in train at step 6 (rank 0: ")
    (failure,) = verdict.failure_records()
    # The summary turns the verdict into `hang` time: from the rank's last progress to the kill.
    ledger_obj = RankLedger(0, 0, header={"job_start": now - 11}, events=records[1:])
    s = summarize([ledger_obj], launcher=[failure])
    assert s.phases["hang"] == pytest.approx(verdict.stopped - (now - 10 + 0.06), abs=1e-6)
    assert s.attempts[0].failure == verdict.reason


def test_faulthandler_is_registered_by_the_worker_helper():
    from lightning_ett.watch.stacks import register_dump_signal

    register_dump_signal()
    assert faulthandler.unregister(DUMP_SIGNAL)


def test_a_single_rank_outside_any_collective_hung_by_itself():
    alone = trained(1, 30)
    b = blame({1: alone}, {1: IN_LOADER})
    assert (b.rank, b.ambiguous) == (1, False) and "outside any collective" in b.evidence
    assert blame({0: trained(0, 30)}, {0: IN_BARRIER}).ambiguous  # waits for a rank on another node


def test_the_report_prefers_a_node_verdict_with_evidence_over_another_node_guess():
    from lightning_ett.instrument.ledger import RankLedger

    events = [{"kind": "event", "phase": "train", "step": 0, "start": 1.0, "end": 2.0}]
    ledgers = [RankLedger(0, r, header={"job_start": 0.0}, events=list(events)) for r in (0, 1)]
    guess = {"kind": "failure", "attempt": 0, "time": 5.0, "rank": 0, "reason": "hung in train at step 1 (rank 0: x) "
             "[ambiguous]", "root_cause": True, "hang": {"ambiguous": True, "stopped": 5.0, "since": {"0": 2.0}}}
    sure = {"kind": "failure", "attempt": 0, "time": 5.0, "rank": 1, "reason": "hung in train at step 1 (rank 1: y)",
            "root_cause": True, "hang": {"ambiguous": False, "stopped": 5.0, "since": {"1": 2.0}}}
    s = summarize(ledgers, launcher=[guess, sure])
    assert s.attempts[0].failure == "hung in train at step 1 (rank 1: y)"
    assert s.per_rank[0]["hang"] == pytest.approx(3.0) and s.per_rank[1]["hang"] == pytest.approx(3.0)


def test_a_job_that_writes_no_ledger_is_not_called_hung(tmp_path: Path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = HangWatch(tmp_path, HangOptions(HangTimeouts(startup=0.1), grace_s=0.1))
        watch.attempt_started(0, time.time() - 10)  # silent for 10 s, far past `startup`: but no ETTMonitor
        assert watch.poll({0: (sleeper.pid, None)}) is None
        assert sleeper.poll() is None
    finally:
        sleeper.kill()


def test_a_periodically_slow_step_once_seen_raises_the_training_limit():
    t = HangTimeouts(train=1.0, step_factor=10.0, min_steps=5)
    p = trained(0, 50, step_s=0.01)
    assert t.limit(p) == 1.0
    p.update({"kind": "event", "phase": "train", "step": 50, "start": 2000.0, "end": 2004.0})  # a 4 s step
    assert t.limit(p) == pytest.approx(8.0)
