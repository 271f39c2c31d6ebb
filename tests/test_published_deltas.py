"""Published delta versions without training: what a delta holds, how a server applies it, retention of chains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_ett.checkpoint import dcp_io
from lightning_ett.checkpoint import layout as fmt
from lightning_ett.durable.commit import temp_path
from lightning_ett.publish import artifact as pub


def checkpoint(root: Path, step: int, weights: dict[str, torch.Tensor]) -> Path:
    """A committed single-process checkpoint holding ``weights`` as its model."""
    final = root / fmt.checkpoint_name(step)
    tmp = temp_path(final)
    dcp_io.write({"model": weights}, tmp, collective=False)
    fmt.commit_checkpoint(tmp, final, {"global_step": step}, step)
    return final


def trained(steps: int) -> list[dict[str, torch.Tensor]]:
    """A table where each step changes 10 rows, and a dense layer that changes entirely."""
    g = torch.Generator().manual_seed(0)
    weights = {"table.weight": torch.randn(1000, 8, generator=g), "dense.weight": torch.randn(4, 4, generator=g)}
    out = []
    for _ in range(steps):
        weights = {k: v.clone() for k, v in weights.items()}
        weights["table.weight"][torch.randint(0, 1000, (10,), generator=g)] += 1
        weights["dense.weight"] += 0.1
        out.append(weights)
    return out


def publish(tmp_path: Path, versions: list[dict[str, torch.Tensor]], keep: int | None = None,
            full_every: int | None = None) -> list[dict]:
    held, manifests = None, []
    for step, weights in enumerate(versions, start=1):
        request = pub.PublishRequest(str(checkpoint(tmp_path / "ckpt", step, weights)), step, deltas=True,
                                     full_every_n_versions=full_every)
        manifest, held = pub.export(request, tmp_path / "pub", keep, held)
        manifests.append(manifest)
    return manifests


def test_a_server_applying_each_delta_to_what_it_holds_ends_with_the_newest_weights(tmp_path):
    versions = trained(5)
    manifests = publish(tmp_path, versions)
    assert [m.get("kind", "full") for m in manifests] == ["full"] + ["delta"] * 4
    assert manifests[-1]["chain"] == [1, 2, 3, 4] and manifests[-1]["base_version"] == 4
    full = manifests[0]["files"][pub.ARTIFACT_FILE]["bytes"]
    assert all(m["files"][pub.DELTA_FILE]["bytes"] < full / 4 for m in manifests[1:])  # 10 of 1000 rows + the dense
    weights, held = pub.load_published(tmp_path / "pub" / "v000001")
    served = dict(weights)  # a server's own tensors (a model's state_dict()): the delta must land in them
    for number in range(2, 6):
        pub.apply_published_delta(served, tmp_path / "pub" / pub.version_name(number), held["version"])
        held = {"version": number}
        assert all(torch.equal(weights[k], versions[number - 1][k]) for k in weights)  # in place: dense ones too
        assert all(served[k] is weights[k] for k in weights)
    latest, manifest = pub.load_published(tmp_path / "pub")
    assert manifest["version"] == 5 and all(torch.equal(latest[k], versions[-1][k]) for k in latest)


def test_a_delta_for_another_version_is_refused_naming_the_way_out(tmp_path):
    publish(tmp_path, trained(3))
    weights, _ = pub.load_published(tmp_path / "pub" / "v000001")
    with pytest.raises(ValueError, match=r"applies to version 2, not to the version 1 held: load it whole"):
        pub.apply_published_delta(weights, tmp_path / "pub" / "v000003", held_version=1)


def test_retention_keeps_the_versions_a_kept_delta_builds_on_and_full_every_n_starts_new_chains(tmp_path):
    manifests = publish(tmp_path, trained(5), keep=1, full_every=3)
    assert [m.get("kind", "full") for m in manifests] == ["full", "delta", "delta", "full", "delta"]
    assert [n for n, _ in pub.published_versions(tmp_path / "pub")] == [4, 5]  # 5 needs 4; 1-3 are no chain of it
    manifest = json.loads((tmp_path / "pub" / "v000005" / pub.MANIFEST_FILE).read_text())
    assert manifest["chain"] == [4]
