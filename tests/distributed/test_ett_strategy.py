"""ETTStrategy on real gloo ranks: sharding types, exact resume, plan cache, 2 -> 1 rank reshard."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS, run_script
from lightning_ett import summarize_run_dir

JOB = str(SCRIPTS / "ett_job.py")


def run_job(out: Path, *args: str) -> list[dict]:
    proc = run_script(JOB, "--out", str(out), *args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(f, weights_only=False) for f in sorted(out.glob("rank*.pt"))]


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "data_parallel"])
def test_sharded_dlrm_trains_and_the_loss_falls(tmp_path, sharding_type):
    ranks = run_job(tmp_path, "--sharding-type", sharding_type, "--max-steps", "40")
    assert len(ranks) == 2 and all(r["world_size"] == 2 for r in ranks)
    assert all(r["local_world_size"] == "2" for r in ranks)  # Lightning does not set it; TorchRec would assume 8
    assert sharding_type in ranks[0]["plan"]
    for r in ranks:
        losses = r["losses"]
        assert statistics.mean(losses[-8:]) < statistics.mean(losses[:8]) - 0.02, losses
    s = summarize_run_dir(tmp_path / "ett")
    for phase in ("process_group_init", "sharding_plan", "model_init", "train"):
        assert s.phases[phase] > 0, phase


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_resume_from_a_sharded_checkpoint_matches_an_uninterrupted_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    full = run_job(tmp_path / "full", "--max-steps", "12", "--save-every", "6", "--ckpt-dir", str(ckpt))
    assert (ckpt / "step6.ckpt" / "lightning.pt").is_file() and (ckpt / "step6.ckpt" / ".metadata").is_file()
    assert not list(ckpt.glob("*.tmp"))  # nothing half-written left behind
    resumed = run_job(tmp_path / "resumed", "--max-steps", "12", "--resume", str(ckpt / "step6.ckpt"))
    for a, b in zip(full, resumed):
        assert b["global_step"] == 12 and len(b["losses"]) == 6
        assert a["losses"][6:] == b["losses"]
        _assert_same_state(a["model"], b["model"])
        _assert_same_state(a["fused"], b["fused"])  # row-wise Adagrad momentum restored too
    assert summarize_run_dir(tmp_path / "resumed" / "ett").phases["checkpoint_load"] > 0

    # The same checkpoint on 1 rank: DCP reshards the 2-rank tables into one rank's.
    at_six = run_job(tmp_path / "at6", "--max-steps", "6")
    one = run_job(tmp_path / "one", "--devices", "1", "--max-steps", "6", "--resume", str(ckpt / "step6.ckpt"))
    assert len(one) == 1 and one[0]["world_size"] == 1
    union = {**at_six[0]["model"], **at_six[1]["model"]}
    _assert_same_state(union, one[0]["model"])


def test_second_start_loads_the_plan_from_cache_and_other_tables_miss_it(tmp_path):
    cache = tmp_path / "plans"
    first = run_job(tmp_path / "a", "--max-steps", "2", "--plan-cache", str(cache))
    second = run_job(tmp_path / "b", "--max-steps", "2", "--plan-cache", str(cache))
    other = run_job(tmp_path / "c", "--max-steps", "2", "--plan-cache", str(cache), "--rows", "300")
    # Rank 0 plans; rank 1, spawned later, may already find rank 0's entry.
    assert first[0]["plan_source"] == "planner"
    assert {r["plan_source"] for r in second} == {"cache"}
    assert second[0]["plan"] == first[0]["plan"]
    assert other[0]["plan_source"] == "planner"  # other tables: a new entry, not the first one
    assert len(list(cache.glob("plan-*.pkl"))) == 2
