"""AsyncCheckpoint on one process: durability, resume, retention, errors, bad input (real files)."""

from __future__ import annotations

import csv
import itertools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, clean_env, devices_in, launch, run_script
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ett import AsyncCheckpoint
from lightning_ett.checkpoint import layout as fmt
from lightning_ett.checkpoint.staging import Stager
from lightning_ett.durable.commit import REPLACED_SUFFIX
from lightning_ett.instrument.ledger import read_ledger

JOB = str(REPO / "tests" / "scripts" / "async_job.py")


def run_job(tmp_path: Path, *args: str, out: str = "out", ckpt: str = "ckpt", **env: str) -> subprocess.CompletedProcess[str]:
    """One process as ``python SCRIPT``; ``--devices 2`` (DDP) under ``lightning run`` (one import, not one per rank)."""
    job = (JOB, "--out", str(tmp_path / out), "--ckpt-dir", str(tmp_path / ckpt), *args)
    devices = devices_in(args, 1)
    if devices > 1:
        return launch(*job, run_dir=tmp_path / out / "ett", devices=devices, **env)
    return run_script(*job, timeout=240, **env)


def result(tmp_path: Path, out: str = "out") -> dict:
    return torch.load(tmp_path / out / "result.pt", weights_only=False)


def steps_on_disk(root: Path) -> list[int]:
    return [e.step for e in fmt.committed(root)]


def test_resume_after_a_restart_equals_an_uninterrupted_run(tmp_path):
    first = run_job(tmp_path, "--max-steps", "10", "--every", "4", out="a")
    assert first.returncode == 0, first.stderr[-3000:]
    assert steps_on_disk(tmp_path / "ckpt") == [4, 8, 10]  # every 4 steps, plus the end of fit
    assert (tmp_path / "ckpt" / fmt.LATEST_FILE).read_text().strip() == "step-000000010"
    # Restart with a larger budget and no ckpt_path: it resumes from the newest complete checkpoint.
    second = run_job(tmp_path, "--max-steps", "16", "--every", "4", out="b")
    assert second.returncode == 0, second.stderr[-3000:]
    assert str(result(tmp_path, "b")["resumed_from"]).endswith("step-000000010")
    reference = run_script(JOB, "--out", str(tmp_path / "ref"), "--ckpt-dir", str(tmp_path / "ref_ckpt"), "--max-steps", "16")
    assert reference.returncode == 0, reference.stderr[-3000:]
    resumed, uninterrupted = result(tmp_path, "b"), result(tmp_path, "ref")
    assert resumed["global_step"] == uninterrupted["global_step"] == 16
    for name, value in uninterrupted["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, rtol=0, atol=0)
    # ETT: the blocking part of each save is `checkpoint_save`, the load on resume `checkpoint_load`;
    # the background write is logged to the loggers.
    [ledger] = read_ledger(tmp_path / "b" / "ett")
    phases = {e["phase"] for e in ledger.events}
    assert {"checkpoint_save", "checkpoint_load"} <= phases
    [fresh] = read_ledger(tmp_path / "a" / "ett")
    assert "checkpoint_load" not in {e["phase"] for e in fresh.events}  # nothing to resume: nothing loaded
    with open(tmp_path / "b" / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    writes = [float(r["checkpoint/write_s"]) for r in rows if r.get("checkpoint/write_s")]
    assert writes and all(w > 0 for w in writes)
    assert all(float(r["checkpoint/staging_bytes"]) > 0 for r in rows if r.get("checkpoint/staging_bytes"))


def test_an_explicit_ckpt_path_wins_over_automatic_resume(tmp_path):
    assert run_job(tmp_path, "--max-steps", "8", "--every", "4").returncode == 0
    proc = run_job(tmp_path, "--max-steps", "10", "--ckpt-path", str(tmp_path / "ckpt" / "step-000000004"), out="b")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(result(tmp_path, "b")["resumed_from"]).endswith("step-000000004")


def test_a_restart_of_a_job_begun_from_ckpt_path_resumes_from_what_it_committed_since(tmp_path):
    """Going back to ckpt_path at every restart would re-run every step since (a fine-tune from a pretrained
    checkpoint would never get past its MTBF); a relaunch of the job continues it; a new job begins from ckpt_path."""
    assert run_job(tmp_path, "--max-steps", "8", "--every", "4").returncode == 0  # an earlier job: steps 4 and 8
    start = tmp_path / "ckpt" / "step-000000004"
    job = (JOB, "--ckpt-dir", str(tmp_path / "ckpt"), "--every", "3", "--keep", "10", "--step-sleep", "0.2",
           "--ckpt-path", str(start), "--devices", "2")
    restarted = launch(*job, "--out", str(tmp_path / "b"), "--max-steps", "14", run_dir=tmp_path / "b" / "ett",
                       devices=2, max_restarts=1, LIGHTNING_ETT_FAULT_KILL="1:12")  # rank 0 decides, rank 1 follows
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "SIGKILL rank 1 at step 12 of attempt 0" in restarted.stderr
    resumed_from = Path(result(tmp_path, "b")["resumed_from"]).name
    assert resumed_from in ("step-000000006", "step-000000009", "step-000000012"), resumed_from  # this job's
    assert f"has trained since: it resumes from {tmp_path / 'ckpt' / resumed_from}, the newest checkpoint" in (
        restarted.stderr)
    assert result(tmp_path, "b")["global_step"] == 14
    relaunched = launch(*job, "--out", str(tmp_path / "b"), "--max-steps", "17", run_dir=tmp_path / "b" / "ett",
                        devices=2)  # the same job, started again into its run dir (a requeue): it goes on
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    assert Path(result(tmp_path, "b")["resumed_from"]).name == "step-000000014"
    again = launch(*job, "--out", str(tmp_path / "c"), "--max-steps", "14", run_dir=tmp_path / "c" / "ett",
                   devices=2)  # a new job (its run dir has the same name: the same default job id)
    assert again.returncode == 0, again.stderr[-3000:]
    assert Path(result(tmp_path, "c")["resumed_from"]) == start  # a new job: where ckpt_path says
    assert "has trained since" not in again.stderr


def test_only_a_fit_of_the_same_job_begun_from_the_same_ckpt_path_is_continued(tmp_path, monkeypatch):
    """The manifest records the job (its id) and the ckpt_path its fit began from: another job, or another ckpt_path
    (a roll-back, the next stage of a script) finds nothing of its own, whatever the clocks, nodes or attempts."""
    from lightning_ett.instrument import environment as env

    monkeypatch.delenv(env.ENV_LAUNCHER, raising=False)
    assert env.launched_job() is None  # not under `lightning run` (torchrun, python): ckpt_path as given
    assert run_job(tmp_path, "--max-steps", "4", "--every", "4", ckpt="origin").returncode == 0
    origin = str(tmp_path / "origin" / "step-000000004")
    launched = {env.ENV_LAUNCHER: "lightning run", env.ENV_JOB_ID: "job-a", env.ENV_ATTEMPT: "0",
                env.ENV_RUN_DIR: str(tmp_path / "a" / "ett")}
    job = f"job-a in {tmp_path / 'a' / 'ett'}"
    assert run_script(JOB, "--out", str(tmp_path / "a"), "--ckpt-dir", str(tmp_path / "ckpt"), "--max-steps", "12",
                      "--every", "4", "--ckpt-path", origin + "/", **launched).returncode == 0  # (a DCP directory)
    entries = fmt.committed(tmp_path / "ckpt")
    origin = os.path.abspath(origin)  # recorded normalised: `a/b/`, `./a/b` and `a/b` are one checkpoint to begin from
    assert [e.began for e in entries] == [(job, origin)] * 2  # steps 8 and 12
    assert fmt.newest_complete(tmp_path / "ckpt", began=(job, origin)) == entries[-1].path  # its later start
    assert fmt.newest_complete(tmp_path / "ckpt", began=(f"job-a in {tmp_path}", origin)) is None  # another job
    assert fmt.newest_complete(tmp_path / "ckpt", began=(job, str(entries[0].path))) is None  # a roll-back
    writer = entries[-1].process  # a second fit with the same ckpt_path in the same process is not a restart
    assert writer and fmt.newest_complete(tmp_path / "ckpt", began=(job, origin), not_by=writer) is None
    assert re.fullmatch(r"[0-9a-f-]+:\d+@\d+", writer), writer  # boot, pid and start ticks: no wall clock


def test_a_restarted_loop_of_fits_each_with_its_own_dirpath_continues_each_fit_from_its_own_checkpoints(tmp_path):
    """A loop of fits (seeds, settings) from one pretrained checkpoint, a dirpath per fit: after a crash in the second
    fit the script runs again; its first fit finds its own finished line and trains nothing more, its second fit
    continues where it was killed (not from ckpt_path again), and both end as a loop never killed does."""
    from lightning_ett.instrument import environment as env

    assert run_job(tmp_path, "--max-steps", "4", "--every", "4", ckpt="origin").returncode == 0
    origin = str(tmp_path / "origin" / "step-000000004")

    def loop(name: str, *args: str) -> subprocess.CompletedProcess[str]:
        launched = {env.ENV_LAUNCHER: "lightning run", env.ENV_JOB_ID: name, env.ENV_ATTEMPT: "0",
                    env.ENV_RUN_DIR: str(tmp_path / name / "ett")}
        return run_script(JOB, "--out", str(tmp_path / name), "--ckpt-dir", str(tmp_path / name / "ckpt"), "--fits", "2",
                          "--dir-per-fit", "--max-steps", "12", "--every", "4", "--ckpt-path", origin, *args, **launched)

    whole = loop("whole")
    assert whole.returncode == 0 and "Give each fit of a loop its own dirpath" not in whole.stderr
    shared = run_script(JOB, "--out", str(tmp_path / "shared"), "--ckpt-dir", str(tmp_path / "shared" / "ckpt"), "--fits",
                        "2", "--max-steps", "12", "--every", "4", "--ckpt-path", origin)  # one dirpath for both fits
    assert shared.returncode == 0 and " ".join(shared.stderr.split()).count("Give each fit of a loop its own dirpath") == 1
    assert loop("killed", "--kill-in-fit", "1", "--kill-at", "10", "--step-sleep", "0.1",
                "--kill-when-durable").returncode == -9  # fit 1 saved step 8, not 12
    again = loop("killed")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "had already reached max_steps=12" in " ".join(again.stderr.split())  # fit 0, said once
    first, second = (torch.load(tmp_path / "killed" / f"result-{i}.pt", weights_only=False) for i in (0, 1))
    assert Path(first["resumed_from"]) == tmp_path / "killed" / "ckpt" / "fit0" / "step-000000012"
    assert Path(second["resumed_from"]) == tmp_path / "killed" / "ckpt" / "fit1" / "step-000000008"
    for i, resumed in enumerate((first, second)):
        whole = torch.load(tmp_path / "whole" / f"result-{i}.pt", weights_only=False)
        for key, value in whole["weights"].items():
            assert torch.equal(resumed["weights"][key], value), (i, key)


def test_a_relaunch_into_a_finished_jobs_run_dir_says_it_trains_nothing_more_and_how_to_train_again(tmp_path):
    """A run dir is one job: a relaunch into it continues it, also when its fit had finished; then the warning says
    that nothing is left to train and how to begin from ckpt_path again, instead of a silent run of 0 steps."""
    from lightning_ett.instrument import environment as env

    assert run_job(tmp_path, "--max-steps", "4", "--every", "4", ckpt="origin").returncode == 0
    origin = str(tmp_path / "origin" / "step-000000004")
    launched = {env.ENV_LAUNCHER: "lightning run", env.ENV_JOB_ID: "nightly", env.ENV_ATTEMPT: "0",
                env.ENV_RUN_DIR: str(tmp_path / "a" / "ett")}
    args = (JOB, "--out", str(tmp_path / "a"), "--ckpt-dir", str(tmp_path / "ckpt"), "--every", "4", "--ckpt-path", origin)
    first = run_script(*args, "--max-steps", "12", **launched)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "reached max_steps" not in first.stderr and "has trained since" not in first.stderr
    again = run_script(*args, "--max-steps", "12", **launched)
    assert again.returncode == 0, again.stderr[-3000:]
    assert str(result(tmp_path, "a")["resumed_from"]).endswith("step-000000012")
    said = " ".join(again.stderr.split())
    assert "had already reached max_steps=12" in said and "trains nothing more" in said and "--job-id" in said
    longer = run_script(*args, "--max-steps", "16", **launched)  # more steps: continues
    assert longer.returncode == 0, longer.stderr[-3000:]
    said = " ".join(longer.stderr.split())
    assert "has trained since" in said and "reached max_steps" not in said
    assert str(result(tmp_path, "a")["resumed_from"]).endswith("step-000000012")


LR_FIND = """
import sys
sys.path.insert(0, sys.argv[4])
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateFinder
from torch.utils.data import DataLoader
from async_job import Regression, Steps
from lightning_ett import AsyncCheckpoint
trainer = Trainer(accelerator="cpu", max_steps=int(sys.argv[3]), logger=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=sys.argv[1],
                  callbacks=[LearningRateFinder(num_training_steps=5, update_attr=False),
                             AsyncCheckpoint(sys.argv[1] + "/ckpt", every_n_train_steps=4, keep_last_n=10)])
torch.manual_seed(0)
trainer.fit(Regression(64, 0.0), DataLoader(Steps(), batch_size=None), ckpt_path=sys.argv[2])
"""


def test_a_tuners_restore_inside_the_fit_leaves_where_the_fit_began_and_a_relaunch_continues(tmp_path):
    """Review 69: Lightning's LearningRateFinder restores its temporary checkpoint through resume_start inside the
    fit; that restore was taken for the fit's own, so every checkpoint said the fit began from `.lr_find_*.ckpt` and
    a relaunch went back to ckpt_path."""
    from lightning_ett.instrument import environment as env

    assert run_job(tmp_path, "--max-steps", "4", "--every", "4", ckpt="origin").returncode == 0
    origin = str(tmp_path / "origin" / "step-000000004")
    launched = {env.ENV_LAUNCHER: "lightning run", env.ENV_JOB_ID: "tuned", env.ENV_ATTEMPT: "0",
                env.ENV_RUN_DIR: str(tmp_path / "ett")}
    scripts = str(Path(JOB).parent)
    first = run_script("-c", LR_FIND, str(tmp_path), origin, "12", scripts, **launched)
    assert first.returncode == 0, first.stderr[-3000:]
    entries = fmt.committed(tmp_path / "ckpt")
    assert entries and {e.began for e in entries} == {(f"tuned in {tmp_path / 'ett'}", origin)}
    longer = run_script("-c", LR_FIND, str(tmp_path), origin, "16", scripts, **launched)  # relaunched, more steps
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert f"it resumes from {tmp_path / 'ckpt' / 'step-000000012'}" in " ".join(longer.stderr.split())


def test_a_ckpt_path_naming_the_checkpoint_directory_itself_says_which_checkpoint_to_pass(tmp_path):
    """A new-user trial (helper 70): under DDP it said `IsADirectoryError: [Errno 21] Is a directory`."""
    assert run_job(tmp_path, "--max-steps", "4", "--every", "4", ckpt="origin").returncode == 0
    proc = run_job(tmp_path, "--max-steps", "8", "--every", "4", "--ckpt-path", str(tmp_path / "origin"))
    said = " ".join(proc.stderr.split())
    assert proc.returncode != 0 and "IsADirectoryError" in said, said[-2000:]  # (the type Lightning's load raised)
    newest = str(tmp_path / "origin" / "step-000000004")
    assert f"It is a directory of checkpoints: pass one of them, e.g. the newest, {newest!r}" in said
    # best_model_path: one of ours named as ckpt_path, where the fit resumes at its end and saves nothing more
    again = run_job(tmp_path, "--max-steps", "4", "--every", "4", "--ckpt-path", newest, ckpt="origin", out="again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "again" / "best_model_path-0.txt").read_text() == newest


def test_the_ckpt_path_a_fit_began_from_is_recorded_in_one_spelling(tmp_path, monkeypatch):
    from lightning_ett.callbacks.checkpoint import _as_begun_from

    monkeypatch.chdir(tmp_path)
    spellings = {_as_begun_from(p) for p in ("ckpt/step-4", "ckpt/step-4/", "./ckpt//step-4", tmp_path / "ckpt" / "step-4")}
    assert spellings == {os.path.join(os.getcwd(), "ckpt", "step-4")}
    assert _as_begun_from("s3://bucket/ckpt/step-4/") == "s3://bucket/ckpt/step-4"
    (tmp_path / "latest").symlink_to(tmp_path / "ckpt")  # a link is its own name: moved to a new target, another one
    assert _as_begun_from("latest/step-4") == os.path.join(os.getcwd(), "latest", "step-4")


def test_the_console_says_a_fits_first_and_last_durable_save_and_verbose_says_each(tmp_path):
    """A new-user trial (helper 67): "auto" in a young job saves every 2-3 steps, and every save printed its line."""
    quiet = run_job(tmp_path, "--max-steps", "12", "--every", "2", "--keep", "10")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    lines = [line for line in quiet.stderr.splitlines() if "is durable at" in line]
    assert len(lines) == 2 and "step 2 is durable" in lines[0], lines
    assert "step 12 is durable" in lines[1] and "4 more durable since the last line" in lines[1], lines
    assert steps_on_disk(tmp_path / "ckpt") == [2, 4, 6, 8, 10, 12]  # (every save made, only fewer lines)
    # A fit that ends without its last save (an error here; max_epochs or EarlyStopping at a saved step alike) still
    # says what became durable since the last line (review 69).
    failed = run_job(tmp_path, "--max-steps", "30", "--every", "2", "--keep", "10", "--raise-at", "11", "--step-sleep",
                     "0.05", out="n", ckpt="n")
    assert failed.returncode != 0 and "a training error at step 11" in failed.stderr
    unsaid = re.findall(r"(\d+) more saves durable since the last line; the newest, step (\d+), at",
                        " ".join(failed.stderr.split()))
    assert len(unsaid) == 1 and int(unsaid[0][0]) >= 2 and int(unsaid[0][1]) in (6, 8, 10), failed.stderr[-2000:]
    # "auto" with a short MTBF saves every few steps; its cadence line comes with the save's line, not at every save
    auto = run_job(tmp_path, "--max-steps", "60", "--every", "auto", "--mtbf-hours", "0.0002", "--step-sleep", "0.01",
                   out="a", ckpt="a")
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert result(tmp_path, "a")["saves"] >= 5, result(tmp_path, "a")["saves"]  # (8 here; one line each before)
    assert auto.stderr.count("is durable at") == 2 and auto.stderr.count("every_n_train_steps='auto')") <= 2
    verbose = run_job(tmp_path, "--max-steps", "12", "--every", "2", "--keep", "10", "--verbose", out="v", ckpt="v")
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert [int(line.split(" is durable")[0].split()[-1]) for line in verbose.stderr.splitlines()
            if "is durable at" in line] == [2, 4, 6, 8, 10, 12]


def test_kill_9_mid_write_leaves_the_previous_checkpoint_selected(tmp_path):
    assert run_job(tmp_path, "--max-steps", "4", "--every", "4").returncode == 0
    killed = run_job(tmp_path, "--max-steps", "20", "--every", "2", "--kill-at", "7", "--step-sleep", "0.3", out="b",
                     LIGHTNING_ETT_FAULT_WRITE_DELAY_S="60")
    assert killed.returncode == -9
    partial = tmp_path / "ckpt" / "step-000000006.tmp"
    assert partial.is_dir() and (partial / ".metadata").is_file()  # its data is on disk, uncommitted
    assert fmt.newest_complete(tmp_path / "ckpt").name == "step-000000004"
    resumed = run_job(tmp_path, "--max-steps", "8", "--every", "100", out="c")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert str(result(tmp_path, "c")["resumed_from"]).endswith("step-000000004")
    assert not partial.exists()  # cleaned up at start


def test_truncated_and_corrupted_checkpoints_are_skipped_with_a_warning_naming_them(tmp_path):
    assert run_job(tmp_path, "--max-steps", "12", "--every", "4", "--keep", "5").returncode == 0
    root = tmp_path / "ckpt"
    assert steps_on_disk(root) == [4, 8, 12]
    with open(root / "step-000000012" / "__0_0.distcp", "r+b") as f:  # same size, one byte flipped
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    data = (root / "step-000000008" / fmt.META_FILE).read_bytes()
    (root / "step-000000008" / fmt.META_FILE).write_bytes(data[: len(data) // 2])  # truncated
    proc = run_job(tmp_path, "--max-steps", "14", "--every", "100", out="b")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step-000000012': __0_0.distcp fails its CRC-32 check" in proc.stderr
    assert "step-000000008': lightning.pt has" in proc.stderr and "truncated" in proc.stderr
    assert str(result(tmp_path, "b")["resumed_from"]).endswith("step-000000004")


def test_a_failing_writer_raises_on_the_training_thread(tmp_path):
    # A file where the writer needs the directory of step 4: a real OS error in the background thread.
    proc = run_job(tmp_path, "--max-steps", "12", "--every", "4", "--block-tmp-of", "4")
    assert proc.returncode != 0
    assert "CheckpointWriteError: The background checkpoint write failed" in proc.stderr
    assert "step-000000004.tmp" in proc.stderr
    assert not (tmp_path / "out" / "result.pt").exists()  # fit did not return normally


def test_keep_last_n_1_never_leaves_zero_complete_checkpoints(tmp_path):
    # Saves every step, each held 0.2 s before its commit; a watcher lists the directory meanwhile.
    proc = subprocess.Popen([sys.executable, JOB, "--out", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt"),
                             "--max-steps", "30", "--every", "1", "--keep", "1", "--when-busy", "skip",
                             "--step-sleep", "0.02"],
                            env=clean_env(LIGHTNING_ETT_FAULT_WRITE_DELAY_S="0.2"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    seen_one, empty_after_first, polls = False, 0, 0
    while proc.poll() is None:
        n = len(fmt.committed(tmp_path / "ckpt"))
        seen_one = seen_one or n > 0
        empty_after_first += seen_one and n == 0
        polls += 1
        time.sleep(0.002)
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
    assert seen_one and polls > 100
    assert empty_after_first == 0
    assert steps_on_disk(tmp_path / "ckpt") == [30]
    assert fmt.verify(tmp_path / "ckpt" / "step-000000030") is None


def test_a_rollback_to_an_older_checkpoint_becomes_the_newest_line(tmp_path):
    assert run_job(tmp_path, "--max-steps", "12", "--every", "4", "--keep", "3").returncode == 0  # 4, 8, 12
    # Roll back to step 4 explicitly and train on: 6 and 8 are committed after 12, so they are newer.
    proc = run_job(tmp_path, "--max-steps", "8", "--every", "2", "--keep", "3", "--ckpt-path",
                   str(tmp_path / "ckpt" / "step-000000004"), out="b")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [e.step for e in fmt.committed(tmp_path / "ckpt")] == [12, 6, 8]  # commit order; 4 and the old 8 replaced/retired
    assert fmt.newest_complete(tmp_path / "ckpt").name == "step-000000008"
    assert (tmp_path / "ckpt" / fmt.LATEST_FILE).read_text().strip() == "step-000000008"
    assert not list((tmp_path / "ckpt").glob("*" + REPLACED_SUFFIX))
    restarted = run_job(tmp_path, "--max-steps", "9", "--every", "100", out="c")
    assert str(result(tmp_path, "c")["resumed_from"]).endswith("step-000000008")  # not the abandoned 12
    assert result(tmp_path, "c")["global_step"] == 9 and restarted.returncode == 0


def test_sigterm_saves_the_step_where_training_stopped(tmp_path):
    proc = run_job(tmp_path, "--max-steps", "100", "--every", "4", "--sigterm-at", "6", "--step-sleep", "0.01")
    assert "max_steps=100` reached" not in proc.stderr, proc.stderr[-2000:]  # stopped by the signal
    steps = steps_on_disk(tmp_path / "ckpt")
    assert steps[0] == 4 and len(steps) == 2 and 6 <= steps[1] <= 8, steps
    assert fmt.verify(tmp_path / "ckpt" / fmt.checkpoint_name(steps[1])) is None


def test_a_writer_failure_on_rank_zero_stops_every_ddp_rank(tmp_path):
    # Rank 0 writes the checkpoint; its write of step 4 fails. Both ranks must stop, none may hang.
    # As `python SCRIPT`: no launcher stops rank 1 when rank 0 fails, it must stop by itself.
    proc = run_script(JOB, "--out", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt"), "--devices", "2",
                      "--max-steps", "40", "--every", "4", "--block-tmp-of", "4", "--step-sleep", "0.01", timeout=240)
    assert proc.returncode != 0
    failed = "lightning_ett.checkpoint.writer.CheckpointWriteError: The background checkpoint write failed"
    assert f"[rank0]: {failed}: " in proc.stderr  # rank 0's own write
    assert f"[rank1]: {failed} on another rank" in proc.stderr


def test_a_failure_to_take_the_directory_lock_stops_every_ddp_rank(tmp_path):
    # Rank 0 alone takes dirpath's lock; an OSError there (here: the lock's name is a directory) must stop rank 1
    # too, not leave it waiting in the broadcast of rank 0's verdict.
    lock = tmp_path / "ckpt" / ".ett-owner"
    lock.mkdir(parents=True)
    proc = run_script(JOB, "--out", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt"), "--devices", "2",
                      "--max-steps", "4", "--every", "2", timeout=240)
    assert proc.returncode != 0
    assert (f"[rank0]: IsADirectoryError: [Errno 21] AsyncCheckpoint: taking the lock of dirpath="
            f"{str(tmp_path / 'ckpt')!r} failed: Is a directory (EISDIR) at {str(lock)!r}") in proc.stderr, \
        proc.stderr[-3000:]
    assert "[rank1]: RuntimeError: AsyncCheckpoint: taking its dirpath's lock failed on another rank; see its error" \
        in proc.stderr
    assert steps_on_disk(tmp_path / "ckpt") == []


def test_a_save_due_at_the_last_step_while_one_is_written_is_not_called_skipped(tmp_path):
    # Each write takes >= 1 s; steps 5-12 take ~0.1 s: the saves of 8 and 12 come due while 4's (then 8's) is written.
    proc = run_job(tmp_path, "--max-steps", "12", "--every", "4", "--when-busy", "skip", "--step-sleep", "0.01",
                   "--keep", "5", LIGHTNING_ETT_FAULT_WRITE_DELAY_S="1.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping the save of step 8" in proc.stderr  # a real skip mid-fit is still said
    assert "skipping the save of step 12" not in proc.stderr and "saves were skipped" not in proc.stderr
    assert steps_on_disk(tmp_path / "ckpt")[-1] == 12  # the end of fit wrote it
    assert result(tmp_path)["skipped"] == 1, result(tmp_path)


def test_every_n_minutes_saves_on_rank_zeros_clock(tmp_path):
    # 0.004 min = 0.24 s between saves; 30 steps of 0.05 s: about 6 saves, each step after the interval.
    proc = run_job(tmp_path, "--max-steps", "30", "--every-minutes", "0.004", "--step-sleep", "0.05", "--keep", "50")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = steps_on_disk(tmp_path / "ckpt")
    assert len(steps) >= 4 and steps[-1] == 30, steps
    # Measured on the clock, not in steps (a loaded machine runs slower steps): the save of step s
    # happens when the batch of step s - 1 ends, and saves are >= 0.24 s apart on that clock.
    (ledger,) = read_ledger(tmp_path / "out" / "ett")
    step_end = {e["step"] + 1: e["end"] for e in ledger.events if e["phase"] == "train"}
    timed = steps[:-1]  # the last one is the end-of-fit save
    gaps = [step_end[b] - step_end[a] for a, b in itertools.pairwise(timed)]
    assert all(gap >= 0.24 - 0.02 for gap in gaps), (steps, gaps)
    assert len(timed) <= (step_end[30] - step_end[1]) / 0.24 + 2, (steps, gaps)  # and not much more often


def test_ddp_rank_zero_writes_and_a_restart_resumes_on_every_rank(tmp_path):
    first = run_job(tmp_path, "--devices", "2", "--max-steps", "8", "--every", "4", out="a")
    assert first.returncode == 0, first.stderr[-3000:]
    assert steps_on_disk(tmp_path / "ckpt") == [4, 8]
    second = run_job(tmp_path, "--devices", "2", "--max-steps", "12", "--every", "4", out="b")
    assert second.returncode == 0, second.stderr[-3000:]
    reference = run_job(tmp_path, "--devices", "2", "--max-steps", "12", out="ref", ckpt="ref_ckpt")
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert str(result(tmp_path, "b")["resumed_from"]).endswith("step-000000008")
    for name, value in result(tmp_path, "ref")["weights"].items():
        torch.testing.assert_close(result(tmp_path, "b")["weights"][name], value, rtol=0, atol=0)
    # best_model_path on every rank, as Lightning's ModelCheckpoint (a new-user trial: '' on rank 1), and the
    # checkpoint a fit resumed from when it resumed at its end and saved nothing more.
    best = [(tmp_path / "b" / f"best_model_path-{r}.txt").read_text() for r in (0, 1)]
    assert best == [str(tmp_path / "ckpt" / "step-000000012")] * 2, best
    again = run_job(tmp_path, "--devices", "2", "--max-steps", "12", "--every", "4", out="c")
    assert again.returncode == 0, again.stderr[-3000:]
    best = [(tmp_path / "c" / f"best_model_path-{r}.txt").read_text() for r in (0, 1)]
    assert best == [str(tmp_path / "ckpt" / "step-000000012")] * 2, best


def test_staging_reuses_its_buffers_and_copies_every_tensor():
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters())
    stager = Stager()
    first = stager.stage({"model": model.state_dict(), "loops": {"step": 1}})
    buffer = first.state["model"]["weight"]
    assert buffer.data_ptr() != model.weight.data_ptr() and torch.equal(buffer, model.weight)
    with torch.no_grad():
        model.weight.add_(1.0)  # training mutates the live state; the snapshot keeps the old values
    assert not torch.equal(buffer, model.weight)
    second = stager.stage({"model": model.state_dict(), "loops": {"step": 2}})
    assert second.state["model"]["weight"].data_ptr() == buffer.data_ptr()  # same buffer, refilled
    assert torch.equal(second.state["model"]["weight"], model.weight) and second.state["loops"] == {"step": 2}
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()  # Adam creates its state lazily: the structure grows, the buffers are rebuilt
    third = stager.stage({"model": model.state_dict(), "optim": optimizer.state_dict()})
    assert torch.equal(third.state["optim"]["state"][0]["exp_avg"], optimizer.state[model.weight]["exp_avg"])
    assert stager.nbytes == sum(t.numel() * t.element_size() for t in [model.weight, model.bias]) * 3 + 2 * 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "give `every_n_train_steps`"),
        ({"every_n_train_steps": 5, "every_n_minutes": 1.0}, "the two intervals conflict"),
        ({"every_n_train_steps": 0}, "every_n_train_steps=0"),
        ({"every_n_minutes": -1}, "every_n_minutes=-1"),
        ({"every_n_train_steps": 5, "keep_last_n": 0}, "keep_last_n=0"),
        ({"every_n_train_steps": 5, "when_busy": "queue"}, "when_busy='queue'"),
        ({"every_n_train_steps": 5, "incremental": "yes"}, "incremental='yes'"),
        ({"every_n_train_steps": 5, "incremental": True, "full_every_n_saves": 0}, "full_every_n_saves=0"),
        ({"every_n_train_steps": 5, "full_every_n_saves": 3}, "applies only with incremental=True: pass incremental=True"),
    ],
)
def test_bad_arguments_are_named(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        AsyncCheckpoint(tmp_path, **kwargs)


def test_an_unwritable_dirpath_fails_before_the_first_step(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    steps: list[int] = []

    class Model(BoringModel):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            steps.append(batch_idx)
            return super().training_step(batch, batch_idx)

    trainer = Trainer(max_steps=3, callbacks=[AsyncCheckpoint(blocker / "ckpts", every_n_train_steps=1)], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(PermissionError, match=r"AsyncCheckpoint\(dirpath=.*a_file/ckpts'\) is not writable"):
        trainer.fit(Model())
    assert steps == []


class WatchWrites(Callback):
    """Records, after each training step, whether a save was being written in the background then."""

    def __init__(self, root: Path) -> None:
        self.root, self.steps_during_writes = root, []

    def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def]
        if list(self.root.glob("step-*.tmp")):  # the write of a save is held before its commit
            self.steps_during_writes.append(trainer.global_step)


def test_the_write_runs_in_the_background_and_when_busy_skip_skips_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_ETT_FAULT_WRITE_DELAY_S", "0.4")  # every write takes >= 0.4 s
    checkpoint = AsyncCheckpoint(tmp_path / "ckpt", every_n_train_steps=2, when_busy="skip", keep_last_n=None)
    watch = WatchWrites(tmp_path / "ckpt")

    class Slow(BoringModel):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            time.sleep(0.02)
            return super().training_step(batch, batch_idx)

    trainer = Trainer(accelerator="cpu", devices=1, max_steps=30, callbacks=[checkpoint, watch], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match="skipping the save of step .*the previous save is still being written"):
        trainer.fit(Slow())
    assert len(watch.steps_during_writes) >= 5  # training went on while writes were in flight
    # 15 saves due (every 2 of 30 steps), most skipped; a skipped step 30 is saved by the end of fit after all.
    assert checkpoint.skipped > 0 and checkpoint.saves + checkpoint.skipped in (15, 16)
    committed = steps_on_disk(tmp_path / "ckpt")
    assert committed[0] == 2 and committed[-1] == 30 and len(committed) == checkpoint.saves


def test_a_strategy_that_shards_the_model_is_refused_at_the_first_save(tmp_path):
    script = tmp_path / "fsdp2.py"
    script.write_text(f"""
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_ett import AsyncCheckpoint

class Sharded(BoringModel):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])

trainer = Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), max_steps=4, logger=False,
                  callbacks=[AsyncCheckpoint({str(tmp_path / "ckpt")!r}, every_n_train_steps=2)],
                  enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Sharded())
""")
    proc = run_script(str(script), timeout=240)
    assert proc.returncode != 0
    assert "TypeError: AsyncCheckpoint: ModelParallelStrategy shards the model's state" in proc.stderr, proc.stderr[-3000:]
    assert not steps_on_disk(tmp_path / "ckpt")


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs: a real full disk (needs root and mount rights; skipped where they are missing)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], check=False, capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)


def test_a_full_disk_is_reported_as_such_with_the_path(tmp_path, small_disk):
    ckpt = small_disk / "ckpt"
    proc = run_script(JOB, "--out", str(tmp_path / "out"), "--ckpt-dir", str(ckpt), "--max-steps", "6", "--every", "2",
                      "--width", "4096", timeout=240)  # ~0.9 MiB per checkpoint (weights and Adam state)
    assert proc.returncode != 0
    assert "No space left on device (ENOSPC)" in proc.stderr and str(ckpt) in proc.stderr, proc.stderr[-3000:]
    report = run_script("-m", "lightning_ett.launch.cli", "report", str(tmp_path / "out" / "ett"))
    text = " ".join(report.stdout.split())
    assert "No space left on device" in text and "FrameSummary" not in text and "unexpected pos" not in text, text
    assert not fmt.committed(ckpt)  # nothing that could pass for a checkpoint
    assert not list(ckpt.glob("*.tmp"))  # and the failed write's files are gone at once: the disk is full


def test_a_save_that_waits_for_the_previous_one_is_not_charged_the_wait_and_skips_warn_once(tmp_path, monkeypatch):
    """when_busy='wait': the wait is the previous save's (its interval is shorter than its write), not the new
    save's cost, which "auto" and the incremental cost rule read; skips warn once a fit, then a count at its end."""
    from lightning.pytorch.loggers.logger import DummyLogger

    class Metrics(DummyLogger):
        def __init__(self) -> None:
            super().__init__()
            self.logged: list[dict[str, float]] = []

        def log_metrics(self, metrics, step=None):  # type: ignore[no-untyped-def]
            self.logged.append(dict(metrics))

    monkeypatch.setenv("LIGHTNING_ETT_FAULT_WRITE_DELAY_S", "0.4")  # every write held 0.4 s before its commit
    logger = Metrics()
    checkpoint = AsyncCheckpoint(tmp_path / "ckpt", every_n_train_steps=2, when_busy="wait", keep_last_n=1)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=8, callbacks=[checkpoint], logger=logger,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    started = time.perf_counter()
    trainer.fit(BoringModel())
    assert time.perf_counter() - started > 4 * 0.4  # the saves did wait for each other
    blocked = [m["checkpoint/blocked_s"] for m in logger.logged if "checkpoint/blocked_s" in m]
    assert len(blocked) == 4 and max(blocked) < 0.2, blocked

    skipping = AsyncCheckpoint(tmp_path / "skip", every_n_train_steps=1, when_busy="skip", keep_last_n=1)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=12, callbacks=[skipping], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    with pytest.warns(UserWarning) as caught:
        trainer.fit(BoringModel())
    said = [str(w.message) for w in caught if "AsyncCheckpoint" in str(w.message)]
    assert skipping.skipped >= 2
    assert sum("skipping the save of step" in s for s in said) == 1
    assert sum(f"{skipping.skipped} saves were skipped in this fit" in s for s in said) == 1
