"""Hangs under `lightning run`: a recompile is no hang, bad flags fail first, phase starts are announced only while
a watch reads them. (Hangs in every phase, blame, restarts, no false alarms: test_hang_watch_jobs.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import SCRIPTS, lightning_run

from lightning_ett.instrument.ledger import read_launcher_records, read_ledger
from tests.distributed.test_launcher import JOB


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
