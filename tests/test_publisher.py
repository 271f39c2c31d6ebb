"""ModelPublisher on one process: artifacts, manifest, retention, off-path timing, failures, bad input (real files)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torchmetrics
from conftest import REPO, run_script
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ett import AsyncCheckpoint, ModelPublisher, load_published
from lightning_ett.checkpoint import layout as fmt
from lightning_ett.durable.manifest import crc32_of
from lightning_ett.durable.ownership import PUBLISHER_OWNER_FILE, DirectoryInUseError, OwnerLock
from lightning_ett.instrument.ledger import read_ledger
from lightning_ett.instrument.summary import summarize_run_dir
from lightning_ett.publish import artifact as pub

JOB = str(REPO / "tests" / "scripts" / "async_job.py")


def run_job(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_script(JOB, "--out", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt"),
                      "--publish-dir", str(tmp_path / "pub"), *args, timeout=240, **env)


def test_each_durable_checkpoint_is_published_with_its_manifest_and_latest(tmp_path):
    proc = run_job(tmp_path, "--max-steps", "24", "--every", "6", "--publish-keep", "2", "--keep", "2",
                   "--publish-metrics", "train_mse,loss,epoch")
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = tmp_path / "pub"
    facts = summarize_run_dir(tmp_path / "out" / "ett").facts_named("publish")
    # Steps 6, 12, 18, 24 were committed; a publisher that lags publishes the newest and skips older ones.
    count = len(facts)
    assert [f["step"] for f in facts][-1] == 24 and {f["step"] for f in facts} <= {6, 12, 18, 24}
    assert [f["version"] for f in facts] == list(range(1, count + 1))
    versions = pub.published_versions(root)
    assert [v for v, _ in versions] == list(range(max(count - 1, 1), count + 1))  # keep_last_n=2
    assert (root / "latest").read_text().strip() == pub.version_name(count)
    weights, manifest = load_published(root)
    assert manifest["version"] == count and manifest["global_step"] == 24
    assert manifest["source_checkpoint"] == str(tmp_path / "ckpt" / "step-000000024")
    assert set(manifest["metrics"]) == {"train_mse", "loss", "epoch"}
    assert all(isinstance(v, float) for v in manifest["metrics"].values())
    # The artifact is the model at that step: the same tensors the job ended with, no optimizer state.
    final = torch.load(tmp_path / "out" / "result.pt", weights_only=False)["weights"]
    assert set(weights) == set(final)
    for name, value in final.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0)
    plain = torch.load(root / pub.version_name(count) / pub.ARTIFACT_FILE, weights_only=True)  # what a server does
    assert set(plain) == set(final)
    # Nothing pinned is left behind, and checkpoint retention went on as configured.
    assert not list((tmp_path / "ckpt").glob(f"*/{fmt.PIN_FILE}"))
    assert [e.step for e in fmt.committed(tmp_path / "ckpt")] == [18, 24]
    report = run_script("-m", "lightning_ett.launch.cli", "report", str(tmp_path / "out" / "ett"))
    assert f"published models: {count}, latest {pub.version_name(count)} (step 24)" in report.stdout, report.stdout


def test_publishing_never_blocks_training_beyond_the_notification(tmp_path):
    # Each publish takes >= 1.5 s in its process; training goes on meanwhile.
    proc = run_job(tmp_path, "--max-steps", "90", "--every", "30", "--step-sleep", "0.03",
                   LIGHTNING_ETT_FAULT_PUBLISH_DELAY_S="1.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [ledger] = read_ledger(tmp_path / "out" / "ett")
    notifications = {e["step"]: e for e in ledger.events if e["phase"] == "publish" and e.get("step") in (30, 60)}
    assert len(notifications) == 2
    assert max(e["end"] - e["start"] for e in notifications.values()) < 0.05, notifications  # a pipe write and a pin
    manifests = [pub.read_manifest(p) for _, p in pub.published_versions(tmp_path / "pub")]
    assert manifests[-1]["global_step"] == 90
    during_training = [m for m in manifests if m["global_step"] in notifications]
    assert during_training, manifests
    for manifest in during_training:  # while it was being published, training ran on
        notified = notifications[manifest["global_step"]]["end"]
        ran = [e for e in ledger.events if e["phase"] == "train" and notified < e["start"] < manifest["time"]]
        assert len(ran) >= 15, (manifest["global_step"], len(ran))
    # The wait for the last publish at the end of fit is `publish` too: honest, and bounded.
    summary = summarize_run_dir(tmp_path / "out" / "ett")
    assert 1.0 < summary.phases["publish"] < 5.0


def test_a_crashing_publisher_leaves_training_running_and_the_error_reported(tmp_path):
    proc = run_job(tmp_path, "--max-steps", "20", "--every", "5", LIGHTNING_ETT_FAULT_PUBLISH_CRASH="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.load(tmp_path / "out" / "result.pt", weights_only=False)["global_step"] == 20
    assert "exited with code 17 while publishing" in proc.stderr
    assert pub.published_versions(tmp_path / "pub") == []
    summary = summarize_run_dir(tmp_path / "out" / "ett")
    errors = summary.facts_named("publish_error")
    # Started again for each request, each failure reported (a lagging publisher skips superseded checkpoints).
    assert len(errors) >= 2 and errors[-1]["step"] == 20 and all("code 17" in e["error"] for e in errors)
    report = run_script("-m", "lightning_ett.launch.cli", "report", str(tmp_path / "out" / "ett"))
    assert f"{len(errors)} publish error(s), last at step 20" in report.stdout, report.stdout
    assert not list((tmp_path / "ckpt").glob(f"*/{fmt.PIN_FILE}"))


def test_an_unwritable_target_mid_run_is_reported_and_strict_mode_raises_at_the_end(tmp_path):
    lenient = run_job(tmp_path, "--max-steps", "20", "--every", "5", "--break-publish-dir-at", "7")
    assert lenient.returncode == 0, lenient.stderr[-3000:]
    assert torch.load(tmp_path / "out" / "result.pt", weights_only=False)["global_step"] == 20
    facts = summarize_run_dir(tmp_path / "out" / "ett")
    errors = facts.facts_named("publish_error")
    assert errors and errors[-1]["step"] == 20
    assert all(f["step"] <= 5 for f in facts.facts_named("publish"))  # nothing after the directory broke
    assert all("FileExistsError" in e["error"] or "NotADirectoryError" in e["error"] for e in errors), errors

    strict_dir = tmp_path / "strict"
    strict_dir.mkdir()
    strict = run_job(strict_dir, "--max-steps", "20", "--every", "5", "--break-publish-dir-at", "7", "--publish-strict")
    assert strict.returncode != 0
    assert "ModelPublishError: ModelPublisher(strict=True): " in strict.stderr, strict.stderr[-3000:]
    assert [e.step for e in fmt.committed(strict_dir / "ckpt")][-1] == 20  # training itself completed


class WithMetric(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.train_acc = torchmetrics.MeanMetric()


def fit(tmp_path: Path, publisher: ModelPublisher, checkpoint: bool = True) -> Trainer:
    callbacks = [publisher] + ([AsyncCheckpoint(tmp_path / "ckpt", every_n_train_steps=2)] if checkpoint else [])
    trainer = Trainer(default_root_dir=tmp_path, max_steps=4, callbacks=callbacks, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(WithMetric())
    return trainer


def no_steps_ran(tmp_path: Path) -> bool:
    return not (tmp_path / "ckpt").exists() or not fmt.committed(tmp_path / "ckpt")


def test_an_unknown_metric_name_fails_before_the_first_step_naming_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"'val_auc' is not a torchmetrics Metric of WithMetric \(it has: train_acc\)"):
        fit(tmp_path, ModelPublisher(tmp_path / "pub", metrics=["loss", "val_auc"]))
    assert no_steps_ran(tmp_path)


def test_a_publish_dir_another_live_job_publishes_into_is_refused_and_a_fit_frees_its_own(tmp_path):
    # Two jobs publishing into one directory would interleave their versions: a server would see steps go back.
    other = OwnerLock(tmp_path / "pub", PUBLISHER_OWNER_FILE, "another-job", 0)
    other.acquire()  # a live owner: this process, for another job
    try:
        with pytest.raises(DirectoryInUseError, match=r"ModelPublisher\(dirpath=.*pub'\) is in use by job 'another-job'"):
            fit(tmp_path, ModelPublisher(tmp_path / "pub"))
        assert no_steps_ran(tmp_path) and not pub.published_versions(tmp_path / "pub")
    finally:
        other.release()
    # Once that job is gone, a job publishes there, and frees the directory when its fit ends; so does a second fit.
    for _ in range(2):
        fit(tmp_path, ModelPublisher(tmp_path / "pub"))
        assert pub.published_versions(tmp_path / "pub") and not (tmp_path / "pub" / PUBLISHER_OWNER_FILE).exists()


def test_an_unwritable_publish_dir_fails_before_the_first_step(tmp_path):
    (tmp_path / "pub").write_text("a file where the directory should be")
    with pytest.raises(PermissionError, match=r"ModelPublisher\(dirpath=.*pub'\) is not writable"):
        fit(tmp_path, ModelPublisher(tmp_path / "pub"))
    assert no_steps_ran(tmp_path)


def test_a_publisher_without_async_checkpoint_or_with_a_wrong_submodule_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"no AsyncCheckpoint.*Add AsyncCheckpoint\(dirpath="):
        fit(tmp_path, ModelPublisher(tmp_path / "pub"), checkpoint=False)
    with pytest.raises(ValueError, match=r"submodule='dlrm'.*WithMetric has no such submodule"):
        fit(tmp_path, ModelPublisher(tmp_path / "pub", submodule="dlrm"))
    assert no_steps_ran(tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dirpath": ""}, "dirpath=''"),
        ({"dirpath": "p", "keep_last_n": 0}, "keep_last_n=0"),
        ({"dirpath": "p", "metrics": "loss"}, "metrics='loss'"),
        ({"dirpath": "p", "metrics": ["loss", "loss"]}, "is repeated"),
        ({"dirpath": "p", "submodule": ""}, "submodule=''"),
        ({"dirpath": "p", "end_timeout_s": 0}, "end_timeout_s=0"),
        ({"dirpath": "p", "deltas": 1}, "deltas=1"),
        ({"dirpath": "p", "deltas": True, "full_every_n_versions": True}, "full_every_n_versions=True"),
        ({"dirpath": "p", "full_every_n_versions": 2}, "applies only with deltas=True"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        ModelPublisher(**kwargs)


def test_the_export_skips_a_checkpoint_already_published_and_leaves_no_partial_version(tmp_path):
    proc = run_job(tmp_path, "--max-steps", "4", "--every", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    request = pub.PublishRequest(str(tmp_path / "ckpt" / "step-000000004"), 4)
    again, _ = pub.export(request, tmp_path / "pub", keep_last_n=None)  # e.g. the same checkpoint after a restart
    assert again["skipped"] is True
    (tmp_path / "pub" / "v000002.tmp").mkdir()  # what a publisher killed mid-version leaves ...
    (tmp_path / "pub" / "v000000.deleting").mkdir()  # ... or mid-retention
    pub.remove_stale(tmp_path / "pub")
    assert [p.name for p in sorted((tmp_path / "pub").iterdir())] == [pub.LOCK_FILE, "latest", "v000001"]
    manifest = json.loads((tmp_path / "pub" / "v000001" / pub.MANIFEST_FILE).read_text())
    assert manifest["files"][pub.ARTIFACT_FILE]["crc32"] == crc32_of(tmp_path / "pub" / "v000001" / pub.ARTIFACT_FILE)


def test_the_publisher_process_dies_with_the_trainer(tmp_path):
    # A SIGKILLed trainer must not leave a publisher writing versions while the next attempt starts its own.
    code = (
        "import os, signal, sys, time\n"
        "from pathlib import Path\n"
        "from lightning_ett.publish.process import PublisherProcess\n"
        "from lightning_ett.publish.artifact import PublishRequest\n"
        f"p = PublisherProcess(Path({str(tmp_path / 'pub')!r}), None)\n"
        "p.send(PublishRequest('/nonexistent', 1))\n"  # the process is busy with it for 60 s (injected delay)
        "print(p._proc.pid, flush=True)\n"
        "time.sleep(1.0)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = run_script("-c", code, timeout=60, LIGHTNING_ETT_FAULT_PUBLISH_DELAY_S="60")
    child = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 20
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        status = Path(f"/proc/{child}/status").read_text() if Path(f"/proc/{child}/status").exists() else ""
        if "State:\tZ" in status:
            break  # exited, waiting to be reaped by init
        time.sleep(0.1)
    alive = Path(f"/proc/{child}/status").exists() and "State:\tZ" not in Path(f"/proc/{child}/status").read_text()
    assert not alive, f"publisher process {child} outlived its trainer"


def test_version_numbers_only_increase_even_after_the_publish_dir_is_emptied(tmp_path):
    proc = run_job(tmp_path, "--max-steps", "16", "--every", "4", "--step-sleep", "0.05", "--empty-publish-dir-at", "10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = summarize_run_dir(tmp_path / "out" / "ett").facts_named("publish")
    versions = [f["version"] for f in facts]
    assert versions == sorted(set(versions)) and len(versions) >= 2, facts  # strictly increasing, none reused
    on_disk = [v for v, _ in pub.published_versions(tmp_path / "pub")]
    # v000001 was published before the emptying (the job waits for it) and never issued again.
    assert on_disk and min(on_disk) > 1 and max(on_disk) == versions[-1], (facts, on_disk)
    assert (tmp_path / "pub" / "latest").read_text().strip() == pub.version_name(max(on_disk))
