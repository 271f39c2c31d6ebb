"""ETTStrategy on real gloo ranks: sharding types, exact resume, plan cache, 2 -> 1 rank reshard."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, devices_in, launch, rank_facts, run_script

from lightning_ett import summarize_run_dir
from lightning_ett.checkpoint import layout as fmt
from lightning_ett.checkpoint.dcp_io import read_whole
from lightning_ett.instrument.ledger import read_ledger

JOB = str(SCRIPTS / "ett_job.py")


def job(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The job under ``lightning run`` (its run dir: ``out/ett``), as many ranks as its ``--devices`` (default 2)."""
    return launch(JOB, "--out", str(out), *args, run_dir=out / "ett", devices=devices_in(args, 2))


def run_job(out: Path, *args: str) -> list[dict]:
    proc = job(out, *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return rank_facts(out)


def run_plain(out: Path, *args: str) -> list[dict]:
    """The job as ``python SCRIPT``: Lightning starts rank 1 itself, and no launcher stops a rank or sets its env."""
    proc = run_script(JOB, "--out", str(out), *args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return rank_facts(out)


@pytest.mark.parametrize("sharding_type, start", [("table_wise", run_plain), ("row_wise", run_job),
                                                  ("data_parallel", run_job)], ids=["table_wise", "row_wise", "data_parallel"])
def test_sharded_dlrm_trains_and_the_loss_falls(tmp_path, sharding_type, start):
    ranks = start(tmp_path, "--sharding-type", sharding_type, "--max-steps", "40")
    assert len(ranks) == 2 and all(r["world_size"] == 2 for r in ranks)
    # Under `python SCRIPT` Lightning does not set it (ETTStrategy does; TorchRec would assume 8); torchrun does.
    assert all(r["local_world_size"] == "2" for r in ranks)
    assert sharding_type in ranks[0]["plan"]
    assert ranks[0]["lr"] == pytest.approx(0.01 * 0.5**4)  # the user's StepLR stepped as in Lightning
    # Sharded tables go to the fused optimizer; data-parallel tables are replicated and, as in
    # TorchRec, trained by the dense optimizer with the MLPs (8 parameters).
    assert ranks[0]["dense_optimizer_params"] == (12 if sharding_type == "data_parallel" else 8)
    for r in ranks:
        losses = r["losses"]
        assert statistics.mean(losses[-8:]) < statistics.mean(losses[:8]) - 0.02, losses
    s = summarize_run_dir(tmp_path / "ett")
    for phase in ("process_group_init", "sharding_plan", "model_init", "train"):
        assert s.phases[phase] > 0, phase


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


@pytest.mark.parametrize("dense_optimizer", ["adam", "adagrad"])  # lazy and eager optimizer state
def test_resume_from_a_sharded_checkpoint_matches_an_uninterrupted_run(tmp_path, dense_optimizer, uninterrupted_dlrm):
    ckpt = tmp_path / "ckpt"
    opt = ("--dense-optimizer", dense_optimizer)
    if dense_optimizer == "adam":  # the job's default: the session's reference run is this run
        full, made = uninterrupted_dlrm
        shutil.copytree(made, ckpt)
    else:
        full = run_job(tmp_path / "full", *opt, "--max-steps", "12", "--save-every", "6", "--ckpt-dir", str(ckpt))
    assert (ckpt / "step6.ckpt" / "lightning.pt").is_file() and (ckpt / "step6.ckpt" / ".metadata").is_file()
    assert not list(ckpt.glob("*.tmp"))  # nothing half-written left behind
    assert fmt.verify(ckpt / "step6.ckpt") is None  # trainer.save_checkpoint commits with a manifest, as AsyncCheckpoint does
    resumed = run_job(tmp_path / "resumed", *opt, "--max-steps", "12", "--resume", str(ckpt / "step6.ckpt"))
    for a, b in zip(full, resumed):
        assert b["global_step"] == 12 and len(b["losses"]) == 6
        assert a["losses"][6:] == b["losses"]
        _assert_same_state(a["model"], b["model"])
        _assert_same_state(a["fused"], b["fused"])  # row-wise Adagrad momentum restored too
    assert summarize_run_dir(tmp_path / "resumed" / "ett").phases["checkpoint_load"] > 0
    if dense_optimizer != "adam":
        return  # what follows does not depend on the dense optimizer: checked once

    # The same checkpoint on 1 rank: DCP reshards the 2-rank tables into one rank's. (The 2-rank state at
    # step 6 is the checkpoint itself, read whole in this process; one rank holds every table whole.)
    one = run_job(tmp_path / "one", *opt, "--devices", "1", "--max-steps", "6", "--resume", str(ckpt / "step6.ckpt"))
    assert len(one) == 1 and one[0]["world_size"] == 1
    whole = {name.split("@")[0]: value for name, value in one[0]["model"].items()}  # tables: one shard at (0, 0)
    _assert_same_state(read_whole(ckpt / "step6.ckpt", "model"), whole)

    # A file of that checkpoint truncated: the load fails on every rank, naming the file.
    shard = next((ckpt / "step6.ckpt").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    proc = job(tmp_path / "torn", *opt, "--max-steps", "12", "--resume", str(ckpt / "step6.ckpt"))
    assert proc.returncode != 0
    assert f"{str(ckpt / 'step6.ckpt')!r} is not a complete checkpoint: {shard.name} has 100 bytes" in proc.stderr
    # Where AsyncCheckpoint looks for a checkpoint to resume from, the same directory is skipped, named.
    auto = tmp_path / "auto"
    auto.mkdir()
    (ckpt / "step6.ckpt").rename(auto / fmt.checkpoint_name(6))
    with pytest.warns(UserWarning, match=f"Skipping checkpoint .*step-000000006'.*{shard.name} has 100 bytes"):
        assert fmt.newest_complete(auto) is None


def test_a_checkpoint_holds_rank_zeros_copy_of_buffers_the_ranks_keep_apart(tmp_path):
    # BatchNorm's running statistics: each rank updates them from its own batch (DMP's DDP does not broadcast
    # buffers), so at a save the ranks' copies differ. Lightning checkpoints rank 0's; DCP's default
    # de-duplication would write whichever rank had the least to write, and every rank would resume with that.
    ckpt = tmp_path / "ckpt"
    ranks = run_job(tmp_path / "run", "--batchnorm", "--max-steps", "6", "--save-every", "6", "--ckpt-dir", str(ckpt))
    saved = read_whole(ckpt / "step6.ckpt", "model")
    for key in ("bn.running_mean", "bn.running_var"):
        assert not torch.equal(ranks[0]["model"][key], ranks[1]["model"][key]), key  # the case: the copies differ
        assert torch.equal(saved[key], ranks[0]["model"][key]), key
    _assert_same_state({k: v for k, v in saved.items() if "@" not in k and k in ranks[0]["model"]},
                       {k: v for k, v in ranks[0]["model"].items() if k in saved})


def test_a_checkpoint_of_another_model_is_not_retried_and_says_so(tmp_path, uninterrupted_dlrm):
    # A table resized, or a layer added, since the checkpoint was saved: every attempt would fail the same way.
    _, made = uninterrupted_dlrm
    for case, change in (("resized", ("--rows", "240")), ("layer", ("--batchnorm",))):
        out = tmp_path / case
        proc = launch(JOB, "--out", str(out), *change, "--max-steps", "12", "--resume", str(made / "step6.ckpt"),
                      run_dir=out / "ett", max_restarts=2)
        said = " ".join((proc.stdout + proc.stderr).split())
        assert proc.returncode != 0 and "not retried" in said, said[-3000:]
        assert f"The checkpoint {str(made / 'step6.ckpt')!r} does not fit this model" in said
        assert ("Size mismatch" if case == "resized" else "Missing key in checkpoint state_dict: model.bn.") in said
        assert len(summarize_run_dir(out / "ett").attempts) == 1
    # strict_loading=False: the layer added since keeps its initial values, and the job resumes and trains on.
    out = tmp_path / "layer-not-strict"
    ranks = run_job(out, "--batchnorm", "--no-strict-loading", "--max-steps", "12", "--resume", str(made / "step6.ckpt"))
    assert all(r["global_step"] == 12 and len(r["losses"]) == 6 for r in ranks)


def test_a_table_width_fbgemm_cannot_shard_is_not_retried_and_names_the_fix(tmp_path):
    out = tmp_path / "dim6"
    proc = launch(JOB, "--out", str(out), "--embedding-dim", "6", "--max-steps", "2", run_dir=out / "ett", max_restarts=2)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0 and "not retried" in said, said[-3000:]
    assert "not divisible by 4" in said and "embedding_dim that is a multiple of 4" in said
    assert len(summarize_run_dir(out / "ett").attempts) == 1


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

    # A cache file replaced by garbage: named in a warning, set aside, planned again; the job goes on.
    entry = _entry_for(cache, first[0]["plan"])
    entry.write_bytes(b"not a pickle")
    proc = job(tmp_path / "d", "--max-steps", "2", "--plan-cache", str(cache))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"ignoring the plan cache entry {str(entry)!r}" in proc.stderr
    healed = torch.load(tmp_path / "d" / "rank0.pt", weights_only=False)
    assert healed["plan_source"] == "planner" and healed["plan"] == first[0]["plan"]
    assert len(list(cache.glob(f"{entry.name}.corrupt-*"))) >= 1 and entry.stat().st_size > 100  # rewritten


def _entry_for(cache: Path, plan: str) -> Path:
    """The cache file that holds ``plan`` (read by rank 0 of the job that wrote it)."""
    import pickle

    for path in cache.glob("plan-*.pkl"):
        if str(pickle.loads(path.read_bytes())["plan"]) == plan:
            return path
    raise AssertionError(f"no cache entry holds the plan {plan!r}")


def test_a_model_without_torchrec_modules_trains_data_parallel(tmp_path):
    proc = run_script(str(SCRIPTS / "boring_job.py"), "--run-dir", str(tmp_path / "run"), "--ett-strategy", "--devices", "2",
                      "--max-steps", "6", "--save-every", "3", "--ckpt-dir", str(tmp_path / "ckpt"),
                      "--report", str(tmp_path / "report"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    # Lightning treats the strategy as distributed: each rank reads its own share of a map-style dataset.
    for rank in (0, 1):
        assert json.loads((tmp_path / "report" / f"rank{rank}.json").read_text())["sampler"] == "DistributedSampler"
    assert "no TorchRec embedding modules" in proc.stderr
    assert (tmp_path / "ckpt" / "last.ckpt" / "lightning.pt").is_file()
    assert sorted(lg.rank for lg in read_ledger(tmp_path / "run")) == [0, 1]
    # DDP inside DMP keeps the replicas equal, and the checkpoint (step 6, the last) holds exactly that state.
    params = [torch.load(tmp_path / "report" / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert params[0].keys() == params[1].keys() and all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    saved = fmt.load_unsharded(tmp_path / "ckpt" / "last.ckpt")
    assert saved["global_step"] == 6
    assert all(torch.equal(saved["state_dict"][k], params[0][k]) for k in params[0])


def test_runs_under_torchrun(tmp_path):
    proc = run_script("-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", JOB, "--out", str(tmp_path),
                      "--max-steps", "4", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = rank_facts(tmp_path)
    assert len(ranks) == 2 and all(r["global_step"] == 4 and r["world_size"] == 2 for r in ranks)


def test_sigterm_on_rank_zero_stops_every_rank_without_a_blocking_collective_per_step(tmp_path):
    # ETTStrategy replaces Lightning's per-step blocking SIGTERM broadcast with an asynchronous one.
    # Under torchrun Lightning does not forward rank 0's SIGTERM: rank 1 learns of it only from the broadcast.
    proc = run_script("-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", JOB, "--out", str(tmp_path),
                      "--max-steps", "200", "--sigterm-at", "5", timeout=300)
    assert "[rank: 1] Received SIGTERM" not in proc.stderr
    steps = {lg.rank: max(e["step"] for e in lg.events if e["phase"] == "train") for lg in read_ledger(tmp_path / "ett")}
    assert sorted(steps) == [0, 1]
    # The flag travels every `interval` (8) steps and is read at the next one: stop within 2 intervals, not at 200.
    assert all(5 <= last <= 5 + 2 * 8 for last in steps.values()), steps
    assert len(set(steps.values())) == 1, steps  # after the same batch on every rank


def test_ranks_whose_local_plans_disagree_fail_with_a_clear_error(tmp_path):
    proc = job(tmp_path, "--max-steps", "2", "--sharding-type", "table_wise", "--rank1-sharding-type", "row_wise")
    assert proc.returncode != 0
    assert "ranks computed different sharding plans" in proc.stderr


def test_torchrun_restart_after_a_sigkill_reforms_the_process_group(tmp_path):
    # Rank 1 SIGKILLs itself at step 4 of attempt 0; torchrun restarts both ranks once.
    proc = run_script("-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "--max-restarts", "1", JOB,
                      "--out", str(tmp_path), "--max-steps", "10", "--kill-at", "4", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = rank_facts(tmp_path)
    assert [r["global_step"] for r in ranks] == [10, 10]
    s = summarize_run_dir(tmp_path / "ett")
    assert [a.completed for a in s.attempts] == [False, True]
    assert s.lost_s > 0  # attempt 0's steps were re-run (no checkpoint in this job)


def test_tables_built_in_setup_are_planned_after_the_overlap_window(tmp_path):
    proc = job(tmp_path, "--max-steps", "4", "--build-in-setup")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "no TorchRec embedding modules" not in proc.stderr
    ranks = rank_facts(tmp_path)
    assert all(r["plan_source"] == "planner" and "t0" in r["plan"] and "table_wise" in r["plan"] for r in ranks)


def test_each_fused_optimizer_trains_the_tables_and_accumulation_is_warned_about(tmp_path):
    # One rank: fbgemm's CPU kernels; adagrad and sgd (row_wise_adagrad is every other test's).
    proc = run_script(str(SCRIPTS / "fused_optimizers_job.py"), "--out", str(tmp_path), "--optimizers", "adagrad,sgd",
                      "--accumulate", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("adagrad", "sgd")}
    for name, r in results.items():
        assert r["tables"] == 4 and r["tables_moved"], name
        assert r["last_loss"] < r["first_loss"], (name, r)
    assert results["adagrad"]["fused_state"] == ["momentum1"] and results["sgd"]["fused_state"] == []
    assert "`accumulate_grad_batches > 1` accumulates only the dense gradients" in proc.stderr


@pytest.fixture(scope="module")
def small_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """tests/scripts/precision_job.py's default cases, one fit each in one process."""
    out = tmp_path_factory.mktemp("small_jobs")
    proc = run_script(str(SCRIPTS / "precision_job.py"), "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_a_true_half_precision_is_warned_about_the_float32_embeddings_and_no_other_precision_is(small_jobs):
    # No false alarm first: 32-true and bf16-mixed train without the warning. Under bf16-true the dense layers are bf16
    # and the sharded tables' output is float32 by default: warned, naming the cast, which then trains.
    r = small_jobs
    for case in ("32-true", "bf16-mixed"):
        assert r[case]["error"] is None and r[case]["steps"] == 6 and r[case]["warnings"] == [], r[case]
    warned = [w for w in r["bf16-true_cast"]["warnings"] if "return their embeddings in another dtype" in w]
    assert len(warned) == 1 and "precision='bf16-true'" in warned[0] and "emb.to(torch.bfloat16)" in warned[0], r
    assert r["bf16-true_cast"]["error"] is None and r["bf16-true_cast"]["steps"] == 6
    assert r["bf16-true_cast"]["dense_dtype"] == "torch.bfloat16" and r["bf16-true_cast"]["table_dtype"] == "torch.float32"
    assert r["bf16-true"]["warnings"] == r["bf16-true_cast"]["warnings"]  # said before the user's step fails on it
    assert "must have the same dtype" in r["bf16-true"]["error"]
    # a table whose output dtype the user set (TorchRec's ParameterConstraints.output_dtype): no warning, no cast needed
    assert r["16-true_out"]["error"] is None and r["16-true_out"]["steps"] == 6 and r["16-true_out"]["warnings"] == []
    # a sharder's fused output_dtype does not change it here (fbgemm's CPU kernel): warned, and the step fails on it
    assert len(r["16-true_fused"]["warnings"]) == 1 and "must have the same dtype" in r["16-true_fused"]["error"]
    # 64-true: the same mismatch, warned with the cast (no float64 output dtype to set), which trains
    (warned,) = r["64-true_cast"]["warnings"]
    assert "emb.to(torch.float64)" in warned and "output_dtype" not in warned and r["64-true_cast"]["steps"] == 6


def test_a_sharding_type_the_tables_sharder_does_not_offer_fails_fit_naming_it(small_jobs):
    r = small_jobs
    assert r["32-true_ec_row_wise"]["error"] is None and r["32-true_ec_row_wise"]["steps"] == 6  # offered: it trains
    assert r["32-true_ec_row_wise"]["warnings"] == []
    # data_parallel for an EmbeddingCollection: TorchRec fails at the first forward where id counts differ (here one
    # feature, one id per sample: it trains); said before the first step, naming the tables and the fix
    (warned,) = r["32-true_ec_data_parallel"]["warnings"]
    assert warned.startswith("ETTStrategy: EmbeddingCollection table(s) t0 are sharded data_parallel") and (
        "sharding_type='table_wise'" in warned), warned
    error = r["32-true_ec_table_row_wise"]["error"]
    assert error.startswith("ConfigurationError: ETTStrategy: table 't0' (EmbeddingCollection) is constrained to sharding "
                            "type(s) ['table_row_wise'], but EmbeddingCollectionSharder offers only"), error


def test_adam_on_cpu_is_refused_naming_the_argument_before_start_up():
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_ett import ETTStrategy

    trainer = Trainer(accelerator="cpu", devices=1, strategy=ETTStrategy(fused_optimizer="adam"), max_steps=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"ETTStrategy\(fused_optimizer='adam'\) is not supported on CPU"):
        trainer.fit(BoringModel())


def test_a_failed_background_write_raises_on_every_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    # As `python SCRIPT`: no launcher stops the other rank when one fails, each must stop by itself.
    proc = run_script(JOB, "--out", str(tmp_path / "out"), "--max-steps", "12", "--async-every", "4",
                      "--ckpt-dir", str(ckpt), "--block-tmp-of", "4", timeout=300)
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"[rank{rank}]: lightning_ett.checkpoint.writer.CheckpointWriteError" in proc.stderr, proc.stderr[-4000:]
    assert "step-000000004" in proc.stderr and not list(ckpt.glob("step-000000004"))
