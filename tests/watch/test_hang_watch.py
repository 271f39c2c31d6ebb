"""The hang watch's decisions: progress from ledger records, learned limits, the job-level rule, blame, stack dumps."""

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
from lightning_ett.watch.activity import Activity
from lightning_ett.watch.flight_recorder import Collectives, GroupStatus
from lightning_ett.watch.hang import Evidence, blame, find_stall, rank_limit_key, working
from lightning_ett.watch.limits import HangTimeouts, PhaseHistory
from lightning_ett.watch.progress import LedgerTail, RankProgress
from lightning_ett.watch.stacks import DUMP_SIGNAL, parse_dump


def trained(rank: int, steps: int, step_s: float = 0.1, t0: float = 1000.0) -> RankProgress:
    p = RankProgress(rank, last_progress=t0, attempt_start=t0)
    for s in range(steps):
        p.update({"kind": "begin", "phase": "train", "step": s, "time": t0 + s * step_s})
        p.update({"kind": "event", "phase": "train", "step": s, "start": t0 + s * step_s, "end": t0 + (s + 1) * step_s})
    return p


def history(t: HangTimeouts, *observed: tuple[str, float]) -> PhaseHistory:
    h = PhaseHistory(t)
    for key, seconds in observed:
        h.observe(key, seconds)
    return h


# ---------------------------------------------------------------- limits
def test_a_phase_keeps_its_generous_default_until_seen_then_gets_a_safety_factor_times_its_longest_time():
    t = HangTimeouts(checkpoint_save=900.0, safety_factor=5.0, min_limit=15.0, min_observations=3)
    h = history(t, ("checkpoint_save", 2.0), ("checkpoint_save", 8.0))
    assert h.limit("checkpoint_save") == 900.0  # seen twice: still nothing known
    h.observe("checkpoint_save", 1.0)
    assert h.limit("checkpoint_save") == pytest.approx(40.0)  # the longest (8 s), not the median (2 s)
    assert history(t, *[("checkpoint_save", 0.5)] * 3).limit("checkpoint_save") == 15.0  # never under min_limit
    fixed = t.with_fixed(checkpoint_save=3.0)  # --hang-timeout checkpoint_save=3: fixed, never learned
    assert history(fixed, *[("checkpoint_save", 60.0)] * 5).limit("checkpoint_save") == 3.0


def test_steps_are_learned_after_warm_up_and_a_first_step_says_how_long_start_up_took():
    t = HangTimeouts(warmup_steps=2, min_observations=2, safety_factor=5.0, min_limit=1.0)
    h = PhaseHistory(t)
    h.observe_event("train", 30.0, 0, since_attempt_start=12.0)  # the first step compiles: warm-up, not a step time
    h.observe_event("train", 0.5, 1, None)
    assert h.limit("train") == t.train
    h.observe_event("train", 0.4, 2, None)
    h.observe_event("train", 0.6, 3, None)
    assert h.limit("train") == pytest.approx(3.0)
    h.observe_event("train", 0.01, 0, since_attempt_start=20.0)  # a later attempt's first step: start-up seen twice
    assert h.limit("startup") == pytest.approx(100.0)


def test_earlier_attempts_teach_the_limits_and_a_phase_recorded_inside_itself_counts_once():
    events = [{"phase": "train", "step": s, "start": 10.0 + s, "end": 11.0 + s} for s in range(8)]
    events += [{"phase": "checkpoint_load", "start": 5.0, "end": 9.0}, {"phase": "checkpoint_load", "start": 5.5, "end": 8.0}]
    ledger = RankLedger(0, 0, header={"attempt_start": 1.0}, events=events)
    h = PhaseHistory(HangTimeouts(warmup_steps=5, min_observations=1, safety_factor=2.0, min_limit=0.1))
    h.observe_ledgers([ledger])
    assert h.limit("train") == pytest.approx(2.0) and h.limit("startup") == pytest.approx(18.0)
    assert h.learned()["checkpoint_load"] == {"seen": 1, "longest_s": 4.0, "limit_s": 8.0, "escalated": False}


def test_a_phase_the_watch_stopped_the_job_in_gets_its_default_back_so_a_wrong_verdict_cannot_recur():
    t = HangTimeouts(train=600.0, min_observations=1, warmup_steps=0, min_limit=10.0)
    h = history(t, ("train", 0.1), ("eval", 1.0))
    assert h.limit("train") == 10.0
    h.escalate("train")  # e.g. a 30 s idle wait taken for a hang: after the restart it passes
    assert h.limit("train") == 600.0 and h.limit("eval") == 10.0
    h.observe("train", 200.0)
    assert h.limit("train") == 1000.0  # learning goes on above the default
    fixed = PhaseHistory(t.with_fixed(train=2.0))
    fixed.observe("train", 0.1)
    fixed.escalate("train")
    assert fixed.limit("train") == 2.0  # a limit the user fixed stays fixed
    assert t.busy_ceiling("train") == 600.0 and t.with_fixed(train=2.0).busy_ceiling("train") == 600.0
    assert t.with_fixed(eval=3600.0).busy_ceiling("eval") == 3600.0 and t.longest_default() == 1800.0


def test_what_limit_a_rank_is_under():
    p = RankProgress(0, last_progress=1000.0)
    assert rank_limit_key(p) == "startup"  # before its first step
    p.update({"kind": "begin", "phase": "train", "step": 0, "time": 1000.5})
    assert rank_limit_key(p) == "train"  # from its first step on (`--hang-timeout train=S` holds there too)
    p = trained(0, 10)
    p.update({"kind": "begin", "phase": "eval", "time": 1003.0})
    p.update({"kind": "begin", "phase": "checkpoint_save", "time": 1003.1})
    assert rank_limit_key(p) == "checkpoint_save"
    p.update({"kind": "event", "phase": "checkpoint_save", "start": 1003.1, "end": 1003.2})
    assert rank_limit_key(p) == "eval"  # still inside the evaluation that contains the save
    p.update({"kind": "event", "phase": "eval", "start": 1003.0, "end": 1004.0})
    p.update({"kind": "begin", "phase": "model_init", "time": 1004.1})
    assert rank_limit_key(p) == "startup"  # the start-up phases share one limit
    p.update({"kind": "status", "status": "finished", "time": 1005.0})
    assert rank_limit_key(p) == "shutdown"
    p.update({"kind": "begin", "phase": "eval", "time": 1005.5})  # trainer.test after fit
    assert rank_limit_key(p) == "eval"
    p.update({"kind": "event", "phase": "eval", "start": 1005.5, "end": 1009.0})
    p.update({"kind": "begin", "phase": "publish", "time": 1009.1})  # ModelPublisher's last publish, after the status
    assert rank_limit_key(p) == "publish"
    assert not p.exited
    p.update({"kind": "event", "phase": "shutdown", "start": 1010.0, "end": 1011.0})  # written at exit
    assert p.exited


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True])
def test_timeouts_must_be_positive(bad):
    with pytest.raises(ValueError, match="train"):
        HangTimeouts(train=bad)


# ---------------------------------------------------------------- the job-level rule
def test_a_rank_inside_a_long_phase_gives_its_waiting_peers_its_limit():
    t = HangTimeouts(min_observations=1, min_limit=1.0, warmup_steps=0)
    h = history(t, ("train", 0.1), ("checkpoint_save", 3.0))  # saves took up to 3 s: 15 s for this one
    saver, waiter = trained(0, 30), trained(1, 30)
    saver.update({"kind": "begin", "phase": "checkpoint_save", "time": 1003.0})
    waiter.update({"kind": "begin", "phase": "train", "step": 30, "time": 1003.0})
    assert find_stall({1: waiter}, h, 1003.0 + 1.5) is not None  # alone, the waiter would be over its 1 s limit
    assert find_stall({0: saver, 1: waiter}, h, 1003.0 + 1.5) is None
    h2 = history(t, ("train", 0.1), ("checkpoint_save", 60.0))  # saves took up to a minute: 5 min for this one
    stall = find_stall({0: saver, 1: waiter}, h2, 1003.0 + 301)
    assert stall is not None and (stall.phase, stall.limited_by, stall.limit_s) == ("checkpoint_save", 0, 300.0)


def test_the_job_is_silent_only_while_every_rank_is():
    t = HangTimeouts(min_observations=1, min_limit=1.0, warmup_steps=0)
    h = history(t, ("train", 0.1))
    quiet, busy = trained(0, 30), trained(1, 30)
    busy.update({"kind": "begin", "phase": "eval", "time": 1010.0})  # rank 1 still writes
    busy.update({"kind": "event", "phase": "eval", "start": 1010.0, "end": 1010.5})
    assert find_stall({0: quiet, 1: busy}, h, 1011.0) is None
    stall = find_stall({0: quiet, 1: busy}, h, 1012.0)
    assert stall is not None and stall.since == 1010.5


WAITING = Collectives({"gloo/0": GroupStatus(31, 30)})
DONE = Collectives({"gloo/0": GroupStatus(30, 30)})
ON_GPU = Collectives({"nccl/0": GroupStatus(31, 30), "gloo/1": GroupStatus(4, 4)})


def test_a_rank_that_works_clears_the_suspicion_and_says_how():
    e0 = {0: Evidence(100.0, WAITING), 1: Evidence(100.0, DONE)}
    idle = Activity(cpu=0.002, io_per_s=10.0, state="S")
    assert working(e0, e0, {0: idle, 1: idle}) == {}
    assert working(e0, e0, {0: idle, 1: Activity(0.98, 0.0, "R")}) == {1: "its processes used 98% of a core"}
    assert working(e0, e0, {0: idle, 1: Activity(0.0, 5e6, "D")}) == {1: "its processes moved 5.0 MB/s"}
    moved = {0: Evidence(100.0, Collectives({"gloo/0": GroupStatus(31, 31)})), 1: Evidence(100.5, DONE)}
    assert working(e0, moved, {}) == {0: "a collective of it completed", 1: "its ledger moved"}
    # Past the busy ceiling CPU and I/O explain nothing (a livelock burns CPU forever): only ledger, recorder, stack.
    assert working(e0, e0, {0: idle, 1: Activity(0.98, 5e6, "R")}, busy_counts=False) == {}
    assert working(e0, moved, {}, busy_counts=False) == {0: "a collective of it completed", 1: "its ledger moved"}


def test_a_rank_waiting_for_a_nccl_collective_spins_and_its_cpu_time_is_no_evidence():
    spin = {0: Activity(1.0, 0.0, "R")}
    gpu = {0: Evidence(100.0, ON_GPU)}
    assert working(gpu, gpu, spin) == {}
    gloo = {0: Evidence(100.0, WAITING)}  # a gloo wait does not spin: CPU time there is work (a background writer)
    assert working(gloo, gloo, spin) == {0: "its processes used 100% of a core"}
    done = {0: Evidence(100.0, Collectives({"nccl/0": GroupStatus(30, 30)}))}
    assert working(done, done, spin) == {0: "its processes used 100% of a core"}  # nothing pending on the GPU


def dump_text(*frames: tuple[str, int, str]) -> str:
    lines = ["Current thread 0x00007f (most recent call first):"]
    lines += [f'  File "{f}", line {n} in {fn}' for f, n, fn in frames]
    return "\n".join(lines + ['  File "/x/site-packages/lightning/pytorch/trainer/trainer.py", line 1 in fit'])


IN_BARRIER = parse_dump(dump_text(("/x/site-packages/torch/distributed/distributed_c10d.py", 5356, "barrier")))
IN_LOADER = parse_dump(dump_text(("/x/site-packages/torch/utils/data/dataloader.py", 88, "__next__")))
IN_BACKWARD = parse_dump(dump_text(("/x/site-packages/torch/autograd/graph.py", 824, "_engine_run_backward"),
                                   ("/x/site-packages/torch/_tensor.py", 630, "backward")))
# A rank stuck in its own training_step under DDP: DDP's forward wrapper is on the stack, and it is no collective.
IN_OWN_STEP = parse_dump(dump_text(("/job/model.py", 12, "training_step"),
                                   ("/x/site-packages/lightning/pytorch/overrides/base.py", 90, "forward"),
                                   ("/x/site-packages/torch/nn/parallel/distributed.py", 1640, "_run_ddp_forward"),
                                   ("/x/site-packages/torch/nn/parallel/distributed.py", 1700, "forward")))


def test_a_stalled_stack_changes_when_a_rank_polls_and_so_it_is_working():
    a = {0: Evidence(100.0, None, IN_LOADER)}
    b = {0: Evidence(100.0, None, IN_OWN_STEP)}
    assert working(a, b, {}) == {0: "its stack changed"}
    assert working(a, a, {}) == {}


# ---------------------------------------------------------------- blame
def test_the_operating_system_names_a_stopped_rank_and_a_rank_that_gave_no_dump():
    r0, r1 = trained(0, 30), trained(1, 30)
    b = blame({0: r0, 1: r1}, {0: IN_BARRIER, 1: None}, states={0: "S", 1: "T"})
    assert (b.rank, b.source, b.ambiguous) == (1, "os", False) and "stopped (process state T" in b.evidence
    b = blame({0: r0, 1: r1}, {0: IN_BARRIER, 1: None}, states={0: "S", 1: "D"})
    assert (b.rank, b.source) == (1, "os") and "gave no stack dump while rank(s) 0 did" in b.evidence


def test_the_flight_recorder_names_the_rank_behind_in_the_collective_sequence_whatever_the_stacks_say():
    r0, r1 = trained(0, 30), trained(1, 30)
    # On NCCL rank 0 waits at a host sync (.item()), outside any collective frame, and rank 1 looks ahead.
    r1.update({"kind": "begin", "phase": "train", "step": 30, "time": 1003.1})
    b = blame({0: r0, 1: r1}, {0: IN_LOADER, 1: IN_BARRIER}, {0: WAITING, 1: DONE})
    assert (b.rank, b.source) == (1, "flight_recorder")
    assert "rank(s) 0 wait for collective #31, which rank 1 has not enqueued" in b.evidence
    # A deadlock across two groups points both ways: the recorder stays silent and progress decides.
    cycle = {0: Collectives({"gloo/0": GroupStatus(31, 30), "gloo/1": GroupStatus(4, 4)}),
             1: Collectives({"gloo/0": GroupStatus(30, 30), "gloo/1": GroupStatus(5, 4)})}
    b = blame({0: r0, 1: r1}, {}, cycle)
    assert (b.rank, b.source) == (0, "progress")


def test_a_collective_only_some_ranks_call_is_named_by_the_operations_they_wait_in():
    ranks = {r: trained(r, 30) for r in range(3)}
    ops = {0: "gloo:broadcast", 1: "gloo:barrier", 2: "gloo:broadcast"}
    statuses = {r: Collectives({"gloo/0": GroupStatus(31, 30, op)}) for r, op in ops.items()}
    b = blame(ranks, {r: IN_BARRIER for r in ranks}, statuses)
    assert (b.rank, b.source, b.ambiguous) == (1, "flight_recorder", False)
    assert "called different ones (rank 0 gloo:broadcast, rank 1 gloo:barrier, rank 2 gloo:broadcast)" in b.evidence
    two = {r: statuses[r] for r in (0, 1)}  # two ranks: no majority says which one is wrong
    b = blame({r: ranks[r] for r in (0, 1)}, {0: IN_BARRIER, 1: IN_BARRIER}, two)
    assert b.ambiguous and "a collective only some ranks call" in b.evidence


def test_blame_falls_back_to_progress_then_stacks_and_says_when_it_is_ambiguous():
    behind, ahead = trained(1, 30), trained(0, 30)
    ahead.update({"kind": "begin", "phase": "train", "step": 30, "time": 1003.1})
    b = blame({0: ahead, 1: behind}, {0: IN_LOADER, 1: IN_BARRIER})  # progress outranks stacks
    assert (b.rank, b.ambiguous, b.source) == (1, False, "progress") and "before step 30" in b.evidence
    a0, a1 = trained(0, 30), trained(1, 30)
    a0.update({"kind": "begin", "phase": "checkpoint_save", "step": 30, "time": 1003.05})
    assert blame({0: a0, 1: a1}, {}).rank == 1  # rank 0 began a save rank 1 never reached
    r0, r1, r2 = trained(0, 30), trained(1, 30), trained(2, 30)
    b = blame({0: r0, 1: r1, 2: r2}, {0: IN_BARRIER, 1: IN_BACKWARD, 2: IN_OWN_STEP})
    assert (b.rank, b.ambiguous, b.source) == (2, False, "stacks")  # DDP's wrapper is no collective; backward waits
    r1.last_progress -= 1
    b = blame({0: r0, 1: r1}, {0: IN_BARRIER, 1: IN_BARRIER})
    assert (b.rank, b.ambiguous) == (1, True) and "another node" not in b.evidence  # one node: no other node to blame
    b = blame({0: r0, 1: r1}, {0: IN_BARRIER, 1: IN_BARRIER}, num_nodes=2)
    assert "on another node" in b.evidence
    skewed = trained(1, 30, t0=-5000.0)
    assert blame({0: ahead, 1: skewed}, {}).rank == 1  # clock skew cannot move the blame when progress decides


def test_a_single_rank_outside_any_collective_hung_by_itself():
    b = blame({1: trained(1, 30)}, {1: IN_LOADER})
    assert (b.rank, b.ambiguous) == (1, False) and "outside any collective" in b.evidence
    assert blame({0: trained(0, 30)}, {0: IN_BARRIER}).ambiguous


# ---------------------------------------------------------------- stacks and ledgers
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


def test_faulthandler_is_registered_by_the_worker_helper():
    from lightning_ett.watch.stacks import register_dump_signal

    register_dump_signal()
    assert faulthandler.unregister(DUMP_SIGNAL)


# ---------------------------------------------------------------- the watch on real processes
def _ledger(tmp_path: Path, now: float) -> list[dict]:
    ledger = tmp_path / "ledger" / "attempt-0000" / "rank-00000.jsonl"
    ledger.parent.mkdir(parents=True)
    records = [{"kind": "header", "pid": 0}]
    for s in range(8):
        records.append({"kind": "event", "phase": "train", "step": s, "start": now - 10 + s * 0.01,
                        "end": now - 10 + (s + 1) * 0.01})
    ledger.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


BUSY_PY = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass\n"


def test_a_silent_rank_that_works_is_not_stopped_and_the_suspicion_is_recorded(tmp_path: Path):
    _ledger(tmp_path, time.time())
    worker = subprocess.Popen([sys.executable, "-c", BUSY_PY])  # silent in its ledger, busy on its CPU
    time.sleep(0.5)  # past the interpreter's start (it reads its modules: I/O, also evidence of work)
    try:
        watch = HangWatch(tmp_path, HangOptions(HangTimeouts().with_fixed(train=1.0, startup=1.0), grace_s=0.2))
        watch.attempt_started(0, time.time() - 11)
        deadline = time.time() + 4
        while time.time() < deadline:
            assert watch.poll({0: (worker.pid, None)}) is None
            time.sleep(0.1)
        assert worker.poll() is None
        (cleared,) = watch.cleared  # once per silence, however often it was looked at
        assert cleared["working_rank"] == 0 and "of a core" in cleared["evidence"] and cleared["limit_phase"] == "train"
    finally:
        worker.kill()


def test_the_watch_confirms_and_stops_a_silent_idle_process(tmp_path: Path):
    now = time.time()
    records = _ledger(tmp_path, now)
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:  # a worker registers its stack dump before the script starts
        sleeper = subprocess.Popen([sys.executable, "-c", DUMP_PY], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert sleeper.stdout.readline().strip() == "ready"
        watch = HangWatch(tmp_path, HangOptions(HangTimeouts().with_fixed(train=1.0, startup=1.0), grace_s=0.2))
        watch.attempt_started(0, now - 11)
        verdict = None
        deadline = time.time() + 15
        while verdict is None and time.time() < deadline:
            verdict = watch.poll({0: (sleeper.pid, str(log))})
            time.sleep(0.1)
        assert verdict is not None
        assert sleeper.wait(timeout=5) != 0
    finally:
        sleeper.kill()
    assert verdict.rank == 0 and verdict.step == 8
    assert verdict.reason.startswith("hung in train at step 8 (rank 0: <string>:7 in stuck_in_loader"), verdict.reason
    assert log.read_text().count("(most recent call first)") == 4  # two dumps of two threads: did its stack change?
    (failure,) = verdict.failure_records()
    ledger_obj = RankLedger(0, 0, header={"job_start": now - 11}, events=records[1:])
    s = summarize([ledger_obj], launcher=[failure])  # the verdict becomes `hang` time: last progress to the kill
    assert s.phases["hang"] == pytest.approx(verdict.stopped - (now - 10 + 0.08), abs=1e-6)
    assert s.attempts[0].failure == verdict.reason


def test_the_report_prefers_a_node_verdict_with_evidence_over_another_node_guess():
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
        watch = HangWatch(tmp_path, HangOptions(HangTimeouts().with_fixed(startup=0.1), grace_s=0.1))
        watch.attempt_started(0, time.time() - 10)  # silent for 10 s, far past `startup`: but no ETTMonitor
        assert watch.poll({0: (sleeper.pid, None)}) is None
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
