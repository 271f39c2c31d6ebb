"""AsyncCheckpoint under ETTStrategy on 2 real gloo ranks: exact snapshot, automatic exact resume."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from conftest import SCRIPTS, launch, rank_facts
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from lightning_ett.checkpoint import layout as fmt
from lightning_ett.instrument.ledger import read_ledger

JOB = str(SCRIPTS / "ett_job.py")


def run_job(out: Path, *args: str, **env: str) -> list[dict]:
    proc = launch(JOB, "--out", str(out), *args, run_dir=out / "ett", **env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return rank_facts(out)


def load_whole(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint directory read in one process: DCP tensors (unsharded) and lightning.pt."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensors = _load_state_dict_from_keys(checkpoint_id=str(path))
    return tensors, torch.load(path / fmt.META_FILE, weights_only=False)


def assert_equal_trees(a: Any, b: Any, path: str = "") -> int:
    """Exact equality of two nested states; returns how many tensors were compared."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
        return 1
    if isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        return sum(assert_equal_trees(a[k], b[k], f"{path}.{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        return sum(assert_equal_trees(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    assert a == b, (path, a, b)
    return 0


def without_timings(state: Any) -> Any:
    """AsyncCheckpoint's measured step and save times (its cadence state) differ by when they were read."""
    if isinstance(state, dict):
        return {k: without_timings(v) for k, v in state.items() if k != "cadence"}
    return state


def test_the_async_snapshot_equals_a_synchronous_save_at_the_same_step_while_training_ran_on(tmp_path):
    # Each write is held 1 s before its commit, so steps 5.. run while step 4's checkpoint is written.
    ckpt = tmp_path / "ckpt"
    run_job(tmp_path, "--max-steps", "16", "--async-every", "4", "--ckpt-dir", str(ckpt), "--sync-ref-at", "4",
            LIGHTNING_ETT_FAULT_WRITE_DELAY_S="1")
    ours, reference = load_whole(ckpt / "step-000000004"), load_whole(tmp_path / "ref")
    assert set(ours[0]) == {"model", "fused"}  # sharded tables and the fused row-wise Adagrad state
    assert assert_equal_trees(ours[0], reference[0]) >= 8
    assert assert_equal_trees(ours[1]["optimizer_states"], reference[1]["optimizer_states"]) > 0  # dense Adam
    for key in ("loops", "lr_schedulers", "global_step", "epoch", "callbacks"):
        assert_equal_trees(without_timings(ours[1][key]), without_timings(reference[1][key]), key)
    # Training went on during the write: steps after 4 finished before step 4 was committed.
    committed_at = json.loads((ckpt / "step-000000004" / fmt.MANIFEST_FILE).read_text())["time"]
    for ledger in read_ledger(tmp_path / "ett"):
        later = [e for e in ledger.events if e["phase"] == "train" and e.get("step", 0) > 5 and e["end"] < committed_at]
        assert len(later) >= 3, ledger.rank
    assert fmt.newest_complete(ckpt).name == "step-000000016"  # the end-of-fit save, after waiting


def test_a_restarted_job_resumes_automatically_and_matches_an_uninterrupted_run(tmp_path, uninterrupted_dlrm):
    ckpt = tmp_path / "ckpt"
    full, _ = uninterrupted_dlrm  # the same 12 steps, uninterrupted
    run_job(tmp_path / "first", "--max-steps", "6", "--async-every", "3", "--ckpt-dir", str(ckpt))
    resumed = run_job(tmp_path / "second", "--max-steps", "12", "--async-every", "3", "--ckpt-dir", str(ckpt))
    for a, b in zip(full, resumed, strict=True):
        assert b["global_step"] == 12 and len(b["losses"]) == 6  # resumed at step 6 without a ckpt_path
        assert a["losses"][6:] == b["losses"]
        assert_equal_trees(a["model"], b["model"])
        assert_equal_trees(a["fused"], b["fused"])
    assert [e.step for e in fmt.committed(ckpt)] == [6, 9, 12]  # keep_last_n=3


def test_every_n_minutes_on_two_ranks_saves_at_the_same_step_everywhere(tmp_path):
    # Rank 0's clock decides; the decision travels every 16 steps, so saves land on multiples of 16.
    ckpt = tmp_path / "ckpt"
    run_job(tmp_path, "--max-steps", "70", "--async-minutes", "0.002", "--async-keep", "10", "--ckpt-dir", str(ckpt))
    steps = [e.step for e in fmt.committed(ckpt)]
    assert steps[-1] == 70 and len(steps) >= 2, steps
    assert all(step % 16 == 0 for step in steps[:-1]), steps
    for step in steps:
        assert fmt.verify(ckpt / fmt.checkpoint_name(step)) is None
