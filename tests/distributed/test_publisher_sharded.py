"""ModelPublisher under ETTStrategy on 2 real gloo ranks: the published model serves what the sharded one predicts."""

from __future__ import annotations

import json

import pytest
from conftest import SCRIPTS, launch, run_script

from lightning_ett.checkpoint import layout as fmt


@pytest.mark.parametrize("incremental", [False, True], ids=["full-saves", "incremental-saves"])
def test_a_published_model_loaded_with_torch_and_torchrec_alone_predicts_what_the_sharded_model_did(tmp_path, incremental):
    # Table-wise sharding on 2 ranks: each rank holds only 2 of the 4 tables. Incremental: the published step's
    # checkpoint is a delta (full save at 5, deltas at 10 and 12), so the publisher reads the whole chain.
    chain = ["--incremental", "--full-every", "10", "--when-busy", "wait"] if incremental else []
    proc = launch(str(SCRIPTS / "ett_job.py"), "--out", str(tmp_path), "--max-steps", "12", "--async-every", "5", *chain,
                  "--ckpt-dir", str(tmp_path / "ckpt"), "--publish-dir", str(tmp_path / "pub"),
                  "--predict-out", str(tmp_path / "pred"), "--sharding-type", "table_wise", run_dir=tmp_path / "ett")
    assert proc.returncode == 0, proc.stderr[-4000:]
    if incremental:
        assert json.loads((tmp_path / "ckpt" / fmt.checkpoint_name(12) / fmt.MANIFEST_FILE).read_text())["kind"] == "delta"
    assert "ModelPublisher: published" in proc.stderr + proc.stdout
    assert not list((tmp_path / "ckpt").glob(f"*/{fmt.PIN_FILE}"))
    served = run_script(str(SCRIPTS / "serve_published.py"), str(tmp_path / "pub"), str(tmp_path / "pred"), "200",
                        fresh=True)  # (fresh: what the server imports, and that Lightning is not among it, is tested)
    assert served.returncode == 0, served.stderr[-4000:]
    result = json.loads(served.stdout.strip().splitlines()[-1])
    assert result["ranks"] == 2
    assert result["global_step"] == 12 and result["trained_steps"] == [12]  # the same step
    assert result["max_abs_diff"] < 1e-5, result
    assert result["lightning_imported"] is False
    manifest = json.loads((tmp_path / "pub" / f"v{result['version']:06d}" / "manifest.json").read_text())
    assert manifest["submodule"] == "dlrm" and isinstance(manifest["metrics"]["loss"], float)


def test_published_deltas_applied_one_by_one_by_a_server_give_the_trained_model(tmp_path):
    # Incremental checkpoints at 4, 8, 12 (and the end-of-fit 14) published as one full version then deltas.
    proc = launch(str(SCRIPTS / "ett_job.py"), "--out", str(tmp_path), "--max-steps", "14", "--async-every", "4",
                  "--incremental", "--full-every", "10", "--when-busy", "wait", "--ckpt-dir", str(tmp_path / "ckpt"),
                  "--publish-dir", str(tmp_path / "pub"), "--publish-deltas", "--predict-out", str(tmp_path / "pred"),
                  "--sharding-type", "row_wise", "--rows", "2000", "--batch", "16", run_dir=tmp_path / "ett")
    assert proc.returncode == 0, proc.stderr[-4000:]
    served = run_script(str(SCRIPTS / "serve_published_deltas.py"), str(tmp_path / "pub"), str(tmp_path / "pred"), "2000",
                        fresh=True)
    assert served.returncode == 0, served.stderr[-4000:]
    result = json.loads(served.stdout.strip().splitlines()[-1])
    assert result["kinds"][0] == "full" and "delta" in result["kinds"][1:], result
    assert result["global_step"] == 14 and result["same_as_rebuilt"] is True
    assert result["max_abs_diff"] < 1e-5, result
    assert result["lightning_imported"] is False
    sizes = {kind: [] for kind in ("full", "delta")}
    for version in sorted((tmp_path / "pub").glob("v*")):
        manifest = json.loads((version / "manifest.json").read_text())
        sizes[manifest.get("kind", "full")].append(sum(f["bytes"] for f in manifest["files"].values()))
    assert max(sizes["delta"]) < min(sizes["full"]), sizes  # only the rows that changed


def test_every_manifest_names_every_metric_asked_for_after_a_restart_too(tmp_path):
    # Rank 1 is killed at step 9 of the first attempt; the restarted job publishes the checkpoint it resumed from,
    # whose step's loss was taken by the dead attempt: the manifest says null, not nothing (a server reads the key).
    proc = launch(str(SCRIPTS / "ett_job.py"), "--out", str(tmp_path), "--max-steps", "12", "--async-every", "4",
                  "--ckpt-dir", str(tmp_path / "ckpt"), "--publish-dir", str(tmp_path / "pub"), "--kill-at", "9",
                  run_dir=tmp_path / "ett", max_restarts=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    manifests = [json.loads(m.read_text()) for m in sorted((tmp_path / "pub").glob("v*/manifest.json"))]
    assert manifests and all(set(m["metrics"]) == {"loss"} for m in manifests), manifests
    assert isinstance(manifests[-1]["metrics"]["loss"], float)  # the last: saved and published by the same attempt
