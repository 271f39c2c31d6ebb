from __future__ import annotations

import pytest

from lightning_ett.instrument.ledger import RankLedger
from lightning_ett.instrument.summary import summarize


def ledger(attempt: int, rank: int, events: list[tuple], job_start: float | None = None, status: str | None = None) -> RankLedger:
    lg = RankLedger(attempt=attempt, rank=rank, status=status)
    if job_start is not None:
        lg.header = {"job_start": job_start}
    for phase, start, end, *step in events:
        e = {"phase": phase, "start": start, "end": end, "rank": rank, "attempt": attempt}
        if step:
            e["step"] = step[0]
        lg.events.append(e)
    return lg


def test_nested_save_and_eval_are_not_effective_and_gaps_are_classified():
    lg = ledger(0, 0, [
        ("import", 1.0, 2.0),
        ("train", 3.0, 5.0, 0),
        ("checkpoint_save", 4.0, 4.5),
        ("train", 5.0, 7.0, 1),
        ("eval", 5.5, 6.0),
    ], job_start=0.0, status="finished")
    s = summarize([lg])
    assert s.wall_s == 7.0
    assert s.phases["launch"] == 1.0  # job start -> first event
    assert s.phases["other"] == 1.0  # uncovered 2..3 inside the attempt
    assert s.phases["train"] == pytest.approx(3.0)
    assert s.phases["checkpoint_save"] == 0.5 and s.phases["eval"] == 0.5
    assert s.ett_percent == pytest.approx(100 * 3 / 7)
    assert sum(s.phases.values()) == pytest.approx(s.wall_s)
    assert s.completed


def test_steps_a_later_attempt_repeated_are_lost_not_effective():
    first = ledger(0, 0, [("train", 0.0, 1.0, 0), ("train", 1.0, 2.0, 1), ("train", 2.0, 3.0, 2), ("train", 3.0, 4.0, 3)],
                   job_start=0.0)
    # the restart resumes from the checkpoint of step 2: steps 2 and 3 of attempt 0 are lost
    second = ledger(1, 0, [("checkpoint_load", 5.0, 5.5), ("train", 5.5, 6.5, 2), ("train", 6.5, 7.5, 3)], status="finished")
    s = summarize([first, second])
    assert len(s.attempts) == 2
    assert s.lost_s == pytest.approx(2.0)
    assert s.effective_s == pytest.approx(4.0)
    assert s.phases["launch"] == pytest.approx(1.0)  # restart downtime 4..5
    assert s.wall_s == 7.5
    assert not s.attempts[0].completed and s.attempts[1].completed


def test_running_attempt_can_count_lost_steps_before_it_trains():
    first = ledger(0, 0, [("train", 0.0, 1.0, 0), ("train", 1.0, 2.0, 1)], job_start=0.0)
    s = summarize([first], later_resume_step=1)
    assert s.lost_s == pytest.approx(1.0) and s.effective_s == pytest.approx(1.0)


def test_job_phases_are_the_mean_over_ranks_and_sum_to_wall():
    r0 = ledger(0, 0, [("train", 0.0, 10.0, 0)], job_start=0.0)
    r1 = ledger(0, 1, [("process_group_init", 2.0, 4.0), ("train", 4.0, 8.0, 0)])
    s = summarize([r0, r1])
    assert s.per_rank[1]["launch"] == 2.0 and s.per_rank[1]["shutdown"] == 2.0
    assert s.phases["train"] == pytest.approx(7.0)
    for totals in s.per_rank.values():
        assert sum(totals.values()) == pytest.approx(s.wall_s)


def test_empty_ledger_is_an_error():
    with pytest.raises(ValueError, match="no events"):
        summarize([RankLedger(attempt=0, rank=0)])


def test_a_failure_naming_another_nodes_address_names_that_node():
    # Node 1 died and its replacement rejoined before node 0 called it lost: rank 0's error is all that is left.
    launcher = [
        {"kind": "launch", "time": 0.0, "node_rank": 0, "address": "10.231.7.1"},
        {"kind": "launch", "time": 0.1, "node_rank": 1, "address": "10.231.7.2"},
        {"kind": "attempt", "attempt": 0, "time": 0.5, "node_rank": 0},
        {"kind": "failure", "attempt": 0, "time": 4.0, "rank": 0, "exitcode": 1, "root_cause": True,
         "reason": "exit code 1: RuntimeError: Read error [10.231.7.2]:58518: Connection reset by peer"},
    ]
    s = summarize([ledger(0, 0, [("train", 1.0, 2.0, 0)], job_start=0.0)], launcher=launcher)
    assert s.attempts[0].failure.endswith("Connection reset by peer (10.231.7.2 is node 1)")
    one_node = [r for r in launcher if r.get("node_rank") != 1]
    s = summarize([ledger(0, 0, [("train", 1.0, 2.0, 0)], job_start=0.0)], launcher=one_node)
    assert s.attempts[0].failure.endswith("Connection reset by peer")  # one node: nothing to tell apart
    launcher[-1]["reason"] = "exit code 1: RuntimeError: Read error [10.231.7.20]:58518"
    s = summarize([ledger(0, 0, [("train", 1.0, 2.0, 0)], job_start=0.0)], launcher=launcher)
    assert s.attempts[0].failure.endswith("[10.231.7.20]:58518")  # another address, however alike


def _partition(rank1_events: list[tuple], failure: dict | None = None, rank0_events: tuple = ()) -> dict[int, dict[str, float]]:
    """Node 1 (rank 1) was last heard at 10 and called lost at 25; node 0 stopped the attempt from 25.5 (SIGTERM) to
    27 (the ranks gone: the failure's time); attempt 1 started at 72."""
    lost = {"node": 1, "address": "10.231.7.2", "since": 10.0, "stopped": 27.0, "stopping": 25.5}
    launcher = [
        {"kind": "launch", "time": 0.0, "node_rank": 0, "address": "10.231.7.1"},
        {"kind": "attempt", "attempt": 0, "time": 0.5, "node_rank": 0},
        {"kind": "node_lost", "node_rank": 1, "address": "10.231.7.2", "since": 10.0, "time": 25.0, "attempt": 0},
        failure or {"kind": "failure", "attempt": 0, "time": 27.0, "rank": 0, "exitcode": -9, "root_cause": True,
                    "reason": "node 1 (10.231.7.2) stopped responding", "node_lost": lost},
        {"kind": "attempt", "attempt": 1, "time": 72.0, "node_rank": 0},
        {"kind": "end", "time": 80.0, "exitcode": 0, "reason": "finished"},
    ]
    launcher.sort(key=lambda r: r["time"])
    rank0 = ledger(0, 0, [("train", 1.0, 9.0, 0), ("train", 9.0, 11.0, 1), *rank0_events], job_start=0.0)
    rank1 = ledger(0, 1, [("train", 1.0, 9.0, 0), *rank1_events], job_start=0.0)
    again = [ledger(1, r, [("train", 73.0, 79.0, 0)], status="finished") for r in (0, 1)]
    return summarize([rank0, rank1, *again], launcher=launcher).per_rank


def test_a_lost_node_owns_its_window_whether_the_partition_cut_a_step_or_a_save_recorded_as_it_unwound():
    # A step cut by the partition is never recorded; a save blocked on the lost node is, when it fails once the
    # link is back (70): both wait on node 1, so the window 10..72 is node_lost either way, on every rank.
    cut_step = _partition([("train", 9.0, 11.0, 1)])
    cut_save = _partition([("train", 9.0, 11.0, 1), ("checkpoint_save", 11.0, 70.0), ("shutdown", 70.0, 70.5)])
    straddling = _partition([("checkpoint_save", 9.0, 70.0)])  # begun before the last heartbeat: its head is its own
    for per_rank in (cut_step, straddling):
        assert per_rank[0]["node_lost"] == pytest.approx(62.0) and per_rank[1]["node_lost"] == pytest.approx(62.0)
    assert straddling[1]["checkpoint_save"] == pytest.approx(1.0)
    # The stalled save's 59 s are the loss's; the rank's own shutdown after the stop stays its own.
    assert cut_save[1]["checkpoint_save"] == 0.0
    assert cut_save[1]["shutdown"] == pytest.approx(cut_step[1]["shutdown"] + 0.5)
    assert cut_save[1]["node_lost"] == pytest.approx(61.5)
    # A save that unwound while the stop was under way (after its SIGTERM at 25.5, before the failure's stamp at 27,
    # taken once the ranks were gone) waited on node 1 all the same; a ledger older than the SIGTERM's time in the
    # failure record has only the stamp.
    unwound = _partition([("train", 9.0, 11.0, 1), ("checkpoint_save", 11.0, 26.5)])
    assert unwound[1]["checkpoint_save"] == 0.0 and unwound[1]["node_lost"] == pytest.approx(62.0)
    older = {"kind": "failure", "attempt": 0, "time": 27.0, "rank": 0, "exitcode": -9, "root_cause": True,
             "reason": "node 1 (10.231.7.2) stopped responding", "node_lost": {"node": 1, "since": 10.0, "stopped": 27.0}}
    assert _partition([("train", 9.0, 11.0, 1), ("checkpoint_save", 11.0, 26.5)], older)[1]["checkpoint_save"] == 15.5
    # A failure of its own (an OOM at 60, not node 0's stop for the loss) ends the attempt: what the ranks finished
    # before it, once node 1 was silent (only its store link: they trained on), keeps its phase.
    oom = {"kind": "failure", "attempt": 0, "time": 60.0, "rank": 0, "exitcode": 1, "root_cause": True,
           "reason": "exit code 1: torch.OutOfMemoryError"}
    trained_on = _partition([("train", 9.0, 11.0, 1), ("eval", 20.0, 40.0)], oom, rank0_events=[("eval", 20.0, 40.0)])
    assert trained_on[0]["eval"] == trained_on[1]["eval"] == pytest.approx(20.0)
    # A save that finished before the attempt was stopped did its work: it keeps its time.
    done = _partition([("train", 9.0, 11.0, 1), ("checkpoint_save", 11.0, 12.0)])
    assert done[1]["checkpoint_save"] == pytest.approx(1.0) and done[1]["node_lost"] == pytest.approx(61.0)
