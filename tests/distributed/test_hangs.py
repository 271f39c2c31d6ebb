"""Hangs under `lightning run`: real gloo ranks that stop making progress, real signals, real restarts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, lightning_run, rank_facts, run_script

from lightning_ett import summarize_run_dir
from lightning_ett.instrument.ledger import read_launcher_records, read_ledger
from tests.distributed.test_async_checkpoint_sharded import assert_equal_trees
from tests.distributed.test_launcher import JOB

STEPS = ["--max-steps", "40", "--async-every", "10", "--step-sleep", "0.02"]
# A step here takes ~30 ms: a 2 s floor is still 60 steps of silence, so a loaded CI machine cannot fake a hang.
WATCH = ["--hang-timeout", "train=2", "--hang-grace", "1"]


@pytest.fixture(scope="module")
def uninterrupted_40(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("uninterrupted-40")
    proc = run_script(JOB, "--out", str(out), "--max-steps", "40", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return rank_facts(out)


# Rank 1 blocks in a collective of a side group no other rank joins; rank 0 waits in the default group for a
# collective rank 1 never enqueues: the flight recorder names rank 1, whose stack (inside a collective) would not.
# (A hang in Python, in every phase: test_hang_watch_jobs.py.)
@pytest.mark.parametrize("switch, function", [("LIGHTNING_ETT_FAULT_HANG_COLLECTIVE", "hang_in_collective")])
def test_a_hung_rank_is_named_stopped_and_restarted_and_the_job_matches_an_uninterrupted_run(
        tmp_path: Path, uninterrupted_40: list[dict], switch: str, function: str) -> None:
    (tmp_path / "out").mkdir()
    proc = lightning_run("--devices", "2", "--max-restarts", "1", *WATCH, "--run-dir", str(tmp_path / "run"), JOB,
                         "--out", str(tmp_path / "out"), *STEPS, "--ckpt-dir", str(tmp_path / "ckpt"), "--ett-from-env",
                         **{switch: "1:30"})  # rank 1 hangs once global step 30 is done, in attempt 0
    assert proc.returncode == 0, proc.stderr[-4000:]

    s = summarize_run_dir(tmp_path / "run")
    assert len(s.attempts) == 2 and [a.completed for a in s.attempts] == [False, True]
    resumed_at = s.attempts[1].first_step
    assert resumed_at in (20, 30), resumed_at  # the newest complete checkpoint before the hang
    for a, b in zip(uninterrupted_40, rank_facts(tmp_path / "out"), strict=True):
        assert b["global_step"] == 40
        assert a["losses"][resumed_at:] == b["losses"]
        assert_equal_trees(a["model"], b["model"])
        assert_equal_trees(a["fused"], b["fused"])

    # The report names the rank, the phase, the step and a frame of the function that hung.
    failure = s.attempts[0].failure
    assert failure.startswith("hung in train at step 30 (rank 1: "), failure
    assert "[ambiguous]" not in failure
    hang = next(r for r in read_launcher_records(tmp_path / "run") if r["kind"] == "failure" and r.get("root_cause"))
    assert hang["rank"] == 1 and hang["hang"]["step"] == 30 and hang["hang"]["phase"] == "train"
    assert any(function in frame for frame in hang["hang"]["frames"]), hang["hang"]["frames"]
    assert hang["hang"]["source"] == "flight_recorder", hang["hang"]
    assert "rank(s) 0 wait for collective #" in hang["hang"]["evidence"]
    assert "hung in train at step 30 (rank 1" in proc.stdout  # the attempts table
    # What the hang cost is its own phase: from each rank's last progress to the kill (at least the 2 s timeout).
    assert s.phases["hang"] >= 2.0 and s.per_rank[1]["hang"] >= 2.0
    assert abs(sum(s.phases.values()) - s.wall_s) < 1e-6
    # Every rank's stacks (all threads) are in a file of its own, not on the console (which says it in one line).
    dumps = sorted((tmp_path / "run" / "stacks" / "attempt-0000").glob("rank-?????.txt"))  # and rank-N.py-spy.txt
    assert [p.name for p in dumps] == ["rank-00000.txt", "rank-00001.txt"]
    assert all(p.read_text().count("(most recent call first)") >= 2 for p in dumps)  # every thread, twice
    assert function in dumps[1].read_text()
    assert "most recent call first" not in proc.stdout + proc.stderr
    assert "lightning run: attempt 0 hung in train at step 30 (rank 1: " in proc.stderr


def test_a_recompile_longer_than_the_step_timeout_is_not_a_hang(tmp_path: Path) -> None:
    # A cold inductor cache: the first step compiles for seconds, and the new batch size at step 8 recompiles for
    # about a second, forward and backward: both far beyond a 0.3 s training-step timeout.
    sizes = ",".join(["64"] * 8 + ["96"] + ["64"] * 7)
    proc = lightning_run("--devices", "1", "--max-restarts", "0", "--hang-timeout", "train=0.3",
                         "--run-dir", str(tmp_path / "ett"), str(SCRIPTS / "compile_job.py"), "--out", str(tmp_path),
                         "--sizes", sizes, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not [r for r in read_launcher_records(tmp_path / "ett") if r["kind"] == "failure"]
    assert json.loads((tmp_path / "compile.json").read_text())["recompiles"] >= 1
    # The test can fail: the compilations after the first steps outlast the training-step timeout.
    (ledger,) = read_ledger(tmp_path / "ett")
    first_train = min(e["end"] for e in ledger.events if e["phase"] == "train" and e.get("step") == 5)
    late = [e["end"] - e["start"] for e in ledger.events if e["phase"] == "compile" and e["start"] > first_train]
    assert max(late) > 0.3, late


def test_bad_hang_flags_and_fault_switches_fail_before_the_job_starts(tmp_path: Path) -> None:
    for flags, env, named in [
        (["--hang-timeout", "train=0"], {}, "--hang-timeout"),
        (["--hang-timeout", "training=5"], {}, "--hang-timeout"),
        (["--hang-safety-factor", "-1"], {}, "--hang-safety-factor"),
        (["--hang-min-limit", "0"], {}, "--hang-min-limit"),
        ([], {"LIGHTNING_ETT_FAULT_HANG": "1"}, "LIGHTNING_ETT_FAULT_HANG"),
        ([], {"LIGHTNING_ETT_FAULT_HANG_COLLECTIVE": "a:b"}, "LIGHTNING_ETT_FAULT_HANG_COLLECTIVE"),
        ([], {"LIGHTNING_ETT_FAULT_SLOW": "1:-2"}, "LIGHTNING_ETT_FAULT_SLOW"),
    ]:
        proc = lightning_run(*flags, "--run-dir", str(tmp_path / "run"), JOB, "--out", str(tmp_path), timeout=60, **env)
        assert proc.returncode == 2, (flags, env, proc.stderr[-2000:])
        assert named in proc.stderr, proc.stderr
        assert not (tmp_path / "run" / "ledger").exists()  # nothing started


def test_ranks_announce_phase_starts_only_while_a_watch_reads_them(tmp_path: Path) -> None:
    proc = lightning_run("--devices", "1", "--no-hang-watch", "--run-dir", str(tmp_path / "run"), JOB, "--devices", "1",
                         "--out", str(tmp_path), "--max-steps", "3", "--ett-from-env")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "ledger" / "attempt-0000" / "rank-00000.jsonl").read_text().splitlines()]
    assert lines and not [r for r in lines if r["kind"] == "begin"]
    assert torch.load(tmp_path / "rank0.pt", weights_only=False)["global_step"] == 3
