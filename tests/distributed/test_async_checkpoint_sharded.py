"""AsyncCheckpoint under ETTStrategy on 2 real gloo ranks: exact snapshot, automatic exact resume."""

from __future__ import annotations

import json
import re
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


def whole_tables(facts: list[dict]) -> dict[str, torch.Tensor]:
    """Each embedding table as a whole tensor, from the ranks' local views (table-wise shards or replicas)."""
    tables: dict[str, torch.Tensor] = {}
    for rank in facts:
        for key, value in rank["model"].items():
            name = key.split("@")[0]
            if "embedding_bags" in name and name.endswith(".weight"):
                assert "@" not in key or key.endswith("(0, 0)"), key  # table-wise: one whole shard
                tables[name] = value
    return tables


def test_a_resume_that_moves_tables_to_data_parallel_and_back_goes_on_warning_what_starts_afresh(tmp_path):
    # A plan change between save and resume: a table the fused optimizer held is now the dense optimizer's
    # (new to it, so its state starts afresh), and back again (the dense optimizer's state for it is left behind, the
    # fused optimizer's starts afresh: the checkpoint holds none for it).
    ckpt = str(tmp_path / "ckpt")
    saved = run_job(tmp_path / "tw", "--max-steps", "6", "--async-every", "3", "--ckpt-dir", ckpt)
    moved = launch(JOB, "--out", str(tmp_path / "dp"), "--max-steps", "6", "--sharding-type", "data_parallel",
                   "--async-every", "3", "--ckpt-dir", ckpt, run_dir=tmp_path / "dp" / "ett")
    assert moved.returncode == 0, moved.stderr[-4000:]
    assert "holds no Adam state for dlrm.sparse_arch.embedding_bag_collection.embedding_bags." in moved.stderr
    assert "their state starts afresh" in moved.stderr
    loaded = rank_facts(tmp_path / "dp")
    assert [f["global_step"] for f in loaded] == [6, 6] and not any(f["losses"] for f in loaded)
    tables = whole_tables(saved)
    assert len(tables) == 4 and all(torch.equal(whole_tables([f])[n], t) for f in loaded for n, t in tables.items())
    on = run_job(tmp_path / "dp2", "--max-steps", "9", "--sharding-type", "data_parallel", "--async-every", "3",
                 "--ckpt-dir", ckpt)  # trains on from step 6: the new state is made at its first step
    assert [len(f["losses"]) for f in on] == [3, 3] and all(f["dense_optimizer_params"] == 12 for f in on)
    back = launch(JOB, "--out", str(tmp_path / "tw2"), "--max-steps", "12", "--async-every", "3", "--ckpt-dir", ckpt,
                  run_dir=tmp_path / "tw2" / "ett")
    assert back.returncode == 0, back.stderr[-4000:]
    assert "which Adam no longer holds (now sharded, under the fused optimizer, or gone): left behind" in back.stderr
    said = re.search(r"holds no embedding optimizer state for (.*) \(data-parallel when it was saved, or new\): their "
                     r"row_wise_adagrad state starts afresh", back.stderr)
    assert said and said.group(1).count("embedding_bags.t") == 4, back.stderr[-3000:]  # every rank's tables, once
    assert [len(f["losses"]) for f in rank_facts(tmp_path / "tw2")] == [3, 3]
