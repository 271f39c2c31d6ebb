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
