"""A rank that stops after writing its part of a checkpoint, before rank 0 commits it (real gloo ranks)."""

from __future__ import annotations

import json

from conftest import SCRIPTS, run_script

from lightning_ett.checkpoint.layout import checkpoint_name


def test_a_checkpoint_committed_after_a_rank_stopped_is_called_complete_not_failed(tmp_path):
    # Every rank agreed that its part was written; then rank 1 died and rank 0 committed. The checkpoint is good
    # and a resume takes it: rank 0's error must say so, not "the write failed".
    root, out = tmp_path / "ckpt", tmp_path / "said.json"
    proc = run_script(str(SCRIPTS / "writer_peer_stops.py"), str(root), str(out), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(out.read_text())
    final = root / checkpoint_name(5)
    assert said["newest_complete"] == str(final)
    assert said["error"] is not None and said["error"].startswith(
        "CommittedUnconfirmedError: A rank stopped at the end of a background checkpoint save: "
        f"checkpoint {str(final)!r} is complete (every rank wrote its part and rank 0 committed it; a resume starts "
        "from it), but another rank stopped before it was told: "), said["error"]
    assert "failed" not in said["error"].split("told: ")[0]
