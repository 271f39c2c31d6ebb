"""benchmarks/launch_start.py's ledger arithmetic: launcher start -> each rank's first finished step, by phase."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lightning_ett.instrument.ledger import LedgerWriter, ledger_path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "launch_start.py"


@pytest.fixture(scope="module")
def launch_start():
    spec = importlib.util.spec_from_file_location("launch_start_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_rank(run_dir: Path, attempt: int, rank: int, process_start: float, events: list[tuple]) -> None:
    writer = LedgerWriter(ledger_path(run_dir, attempt, rank))
    writer.append({"kind": "header", "rank": rank, "attempt": attempt, "job_start": process_start,
                   "attempt_start": process_start, "process_start": process_start})
    for phase, start, end, *step in events:
        record = {"kind": "event", "phase": phase, "start": start, "end": end, "rank": rank, "attempt": attempt}
        if step:
            record["step"] = step[0]
        writer.append(record)
    writer.close()


def test_first_step_counts_from_the_launcher_start_to_each_ranks_first_step(tmp_path, launch_start):
    t0 = 100.0
    write_rank(tmp_path, 0, 0, 101.0, [("import", 101.0, 103.0), ("process_group_init", 103.0, 104.0),
                                       ("train", 104.0, 104.5, 0), ("train", 104.5, 105.0, 1)])
    # rank 1: an overlapped phase nested in another, and a gap nothing covers
    write_rank(tmp_path, 0, 1, 101.5, [("import", 101.5, 103.5), ("model_init", 103.5, 105.0),
                                       ("sharding_plan", 104.0, 104.5), ("train", 105.2, 105.6, 0)])
    write_rank(tmp_path, 1, 0, 200.0, [("train", 201.0, 201.1, 0)])  # a later attempt is not the first start

    ranks = launch_start.first_step(tmp_path, t0)

    assert ranks[0]["total"] == pytest.approx(4.5)
    assert (ranks[0]["launch"], ranks[0]["import"], ranks[0]["process_group_init"], ranks[0]["train"]) == \
        pytest.approx((1.0, 2.0, 1.0, 0.5))
    assert ranks[1]["total"] == pytest.approx(5.6)
    assert ranks[1]["launch"] == pytest.approx(1.5)
    assert ranks[1]["model_init"] == pytest.approx(1.0)  # the innermost event owns the time
    assert ranks[1]["sharding_plan"] == pytest.approx(0.5)
    assert ranks[1]["other"] == pytest.approx(0.2)
    phases = {k: v for k, v in ranks[1].items() if k != "total"}
    assert sum(phases.values()) == pytest.approx(ranks[1]["total"])  # the breakdown adds up


def test_first_step_refuses_a_rank_that_never_trained(tmp_path, launch_start):
    write_rank(tmp_path, 0, 0, 101.0, [("import", 101.0, 103.0)])
    with pytest.raises(RuntimeError, match="rank 0 .* no training step"):
        launch_start.first_step(tmp_path, 100.0)
