"""What lightning-ett 0.1 (the flat layout) wrote still loads: ledgers, checkpoints, published models.

The fixtures under ``fixtures/v0_1_0`` were written by the 0.1 code before the package was
regrouped (see that folder's README): a 2-attempt ``lightning run`` ledger with its summary, a
2-rank sharded AsyncCheckpoint and a ``trainer.save_checkpoint`` directory, a single-process
AsyncCheckpoint, and a published model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, run_script

from lightning_ett import load_published, summarize_run_dir
from lightning_ett.checkpoint import layout as fmt
from lightning_ett.launch.cli import main

LEGACY = Path(__file__).resolve().parent / "fixtures" / "v0_1_0"


def expected_union() -> dict[str, torch.Tensor]:
    """The 0.1 run's final state, sharded tables keyed ``name@offsets``, both ranks together."""
    union: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        union.update(torch.load(LEGACY / "sharded_ckpt" / f"expected_rank{rank}.pt", weights_only=False)["model"])
    return union


def test_a_legacy_ledger_summarizes_to_the_same_numbers_and_reports(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(LEGACY / "run", run)
    then = json.loads((LEGACY / "run" / "ett_summary.json").read_text())
    now = summarize_run_dir(run).to_dict()
    for key in ("ett_percent", "wall_s", "effective_s", "lost_s", "attempts", "completed", "outcome", "torn_records"):
        assert now[key] == then[key], key
    # Phases added since (trainer_init, logger_init, ...) are zero in a ledger that never recorded them.
    assert {k: v for k, v in now["phases"].items() if v or k in then["phases"]} == then["phases"]
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "ETT" in out and "rank 1 killed by SIGKILL" in " ".join(out.split())


def test_a_legacy_single_process_checkpoint_resumes_automatically(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(LEGACY / "single_ckpt", ckpt)
    proc = run_script(str(SCRIPTS / "async_job.py"), "--out", str(tmp_path / "out"), "--ckpt-dir", str(ckpt),
                      "--max-steps", "4", "--every", "4", "--width", "4", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(tmp_path / "out" / "result.pt", weights_only=False)
    expected = torch.load(LEGACY / "single_ckpt" / "expected_result.pt", weights_only=False)
    assert str(result["resumed_from"]).endswith("step-000000004") and result["global_step"] == 4
    assert result["weights"].keys() == expected["weights"].keys()
    assert all(torch.equal(result["weights"][k], expected["weights"][k]) for k in expected["weights"])


def test_a_legacy_sharded_checkpoint_loads_and_reshards_onto_one_rank(tmp_path):
    ckpt = tmp_path / "step-000000006"
    shutil.copytree(LEGACY / "sharded_ckpt" / "step-000000006", ckpt)
    out = tmp_path / "out"
    proc = run_script(str(SCRIPTS / "ett_job.py"), "--out", str(out), "--devices", "1", "--resume", str(ckpt),
                      "--max-steps", "6", "--rows", "16", "--batch", "8", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = torch.load(out / "rank0.pt", weights_only=False)["model"]
    expected = expected_union()
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_a_legacy_synchronous_checkpoint_is_refused_with_the_fix_named(tmp_path):
    legacy = tmp_path / "step6.ckpt"
    shutil.copytree(LEGACY / "sharded_ckpt" / "step6.ckpt", legacy)
    with pytest.raises(FileNotFoundError, match=r"manifest\.json.*lightning_ett\.checkpoint\.adopt"):
        fmt.require_complete(legacy)


def test_a_legacy_published_model_loads_with_its_checksum_verified():
    weights, manifest = load_published(LEGACY / "published")
    assert manifest["version"] == 2 and manifest["global_step"] == 6 and manifest["submodule"] == "dlrm"
    expected = expected_union()
    for name, tensor in weights.items():
        shards = [v for k, v in expected.items() if k.split("@")[0] == f"dlrm.{name}"]
        assert shards and all(torch.equal(s, tensor) for s in shards), name  # table-wise: each table whole
