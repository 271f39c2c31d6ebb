from __future__ import annotations

import time

import pytest

from lightning_ett import Phase, get_timeline, record_phase
from lightning_ett.instrument.ledger import LedgerWriter, ledger_path, read_ledger
from lightning_ett.instrument.summary import summarize


def test_record_phase_as_context_manager_and_decorator_writes_the_ledger(tmp_path):
    tl = get_timeline()
    with record_phase("model_init"):
        time.sleep(0.02)  # recorded before bind: kept in memory

    @record_phase(Phase.DATA_INIT)
    def open_data() -> int:
        time.sleep(0.01)
        return 7

    tl.bind(tmp_path, rank=3, attempt=1, header={"job_start": 1.0})
    assert open_data() == 7
    (ledger,) = read_ledger(tmp_path)
    assert (ledger.rank, ledger.attempt, ledger.header["job_start"]) == (3, 1, 1.0)
    phases = [(e["phase"], e["rank"], e["attempt"]) for e in ledger.events]
    assert phases == [("model_init", 3, 1), ("data_init", 3, 1)]
    assert ledger.events[0]["end"] - ledger.events[0]["start"] >= 0.02


def test_innermost_event_owns_nested_time_in_running_totals():
    tl = get_timeline()
    tl.record("checkpoint_save", 2.0, 3.0)
    tl.record("eval", 4.0, 4.5)
    tl.record("train", 1.0, 5.0, step=0)  # encloses both
    tl.record("train", 5.0, 6.0, step=1)
    assert tl.exclusive_s == pytest.approx({"checkpoint_save": 1.0, "eval": 0.5, "train": 3.5})


def test_a_part_of_a_step_recorded_after_the_step_takes_its_time_from_it(tmp_path):
    # AsyncCheckpoint learns how much slower a step ran during a background write only after the step.
    tl = get_timeline()
    tl.bind(tmp_path, rank=0, attempt=0, header={})
    tl.record("train", 1.0, 2.0, step=0)
    tl.record("train", 2.0, 3.0, step=1)
    carved = tl.carve("checkpoint_save", 0.25, within="train", step=1)
    assert (carved.start, carved.end) == (2.75, 3.0)
    tl.record("train", 3.0, 4.0, step=2)
    assert tl.carve("checkpoint_save", 0.25, within="eval") is None  # the latest event is not one to carve from
    assert tl.exclusive_s == pytest.approx({"train": 2.75, "checkpoint_save": 0.25})
    tl.close()
    summary = summarize(read_ledger(tmp_path))  # the ledger's arithmetic agrees with the running totals
    assert summary.phases["train"] == pytest.approx(2.75)
    assert summary.phases["checkpoint_save"] == pytest.approx(0.25)


def test_unknown_phase_and_reversed_interval_are_rejected():
    with pytest.raises(ValueError, match="Unknown ETT phase 'training'.*train"):
        record_phase("training")
    with pytest.raises(ValueError, match="ends before it starts"):
        get_timeline().record("train", 2.0, 1.0)


def test_reader_skips_a_torn_last_record(tmp_path):
    path = ledger_path(tmp_path, attempt=0, rank=0)
    writer = LedgerWriter(path)
    writer.append({"kind": "event", "phase": "train", "start": 0.0, "end": 1.0, "rank": 0, "attempt": 0, "step": 0})
    writer.close()
    with open(path, "a") as f:
        f.write('{"kind":"event","phase":"tra')  # what a SIGKILL mid-write leaves
    (ledger,) = read_ledger(tmp_path)
    assert len(ledger.events) == 1 and ledger.torn_lines == 1


def test_unwritable_ledger_names_the_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(PermissionError, match="a_file"):
        get_timeline().bind(blocker / "run", rank=0, attempt=0, header={})


def test_missing_ledger_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="No ETT ledger"):
        read_ledger(tmp_path)
