"""AsyncCheckpoint(incremental=True) under ETTStrategy on real gloo ranks: exact resume from a full save and its deltas,
reshard from a chain, a damaged delta, retention, a kill while a delta is written."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, launch, rank_facts

from lightning_ett.checkpoint import delta
from lightning_ett.checkpoint import layout as fmt
from lightning_ett.checkpoint.chain import read_whole
from lightning_ett.checkpoint.delta import DELTA_FILE
from tests.distributed.test_async_checkpoint_sharded import assert_equal_trees, run_job

CHAIN = ["--async-every", "2", "--incremental", "--full-every", "10", "--when-busy", "wait", "--async-keep", "2"]


def manifest(path: Path) -> dict:
    return json.loads((path / fmt.MANIFEST_FILE).read_text())


def step_dir(ckpt: Path, step: int) -> Path:
    return ckpt / fmt.checkpoint_name(step)


@pytest.fixture(scope="module")
def chain_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """7 steps on 2 ranks (table-wise, fused row-wise AdaGrad): full save at 2, deltas at 4, 6 and 7 (end of fit),
    and a synchronous full save of step 7 (``ref``) to compare with. Copy ``ckpt`` before changing it."""
    out = tmp_path_factory.mktemp("chain")
    run_job(out, "--max-steps", "7", *CHAIN, "--ckpt-dir", str(out / "ckpt"), "--sync-ref-at", "7")
    return out


def copied_chain(chain_run: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(chain_run / "ckpt", ckpt)
    (ckpt / ".ett-owner").unlink(missing_ok=True)
    return ckpt


def test_the_chain_is_a_full_save_then_deltas_of_only_the_tables_and_retention_keeps_what_it_needs(chain_run):
    ckpt = chain_run / "ckpt"
    # keep_last_n=2 keeps 6 and 7, and 2 and 4 because 7 is built on them.
    assert [e.step for e in fmt.committed(ckpt)] == [2, 4, 6, 7]
    assert "kind" not in manifest(step_dir(ckpt, 2))
    assert [link["name"] for link in manifest(step_dir(ckpt, 7))["chain"]] == [fmt.checkpoint_name(s) for s in (2, 4, 6)]
    for step in (4, 6, 7):
        files = manifest(step_dir(ckpt, step))["files"]
        assert manifest(step_dir(ckpt, step))["kind"] == "delta"
        assert {DELTA_FILE.format(rank=0), DELTA_FILE.format(rank=1)} <= set(files)  # each rank its own shards' rows
    assert fmt.verify(step_dir(ckpt, 7)) is None


def test_resuming_from_a_full_save_and_three_deltas_matches_an_uninterrupted_run(chain_run, tmp_path, uninterrupted_dlrm):
    ckpt = copied_chain(chain_run, tmp_path)
    full, _ = uninterrupted_dlrm  # the same 12 steps, uninterrupted
    resumed = run_job(tmp_path / "second", "--max-steps", "12", *CHAIN, "--ckpt-dir", str(ckpt))
    for a, b in zip(full, resumed, strict=True):
        assert b["global_step"] == 12 and len(b["losses"]) == 5  # resumed at the delta of step 7
        assert a["losses"][7:] == b["losses"]
        assert_equal_trees(a["model"], b["model"])
        assert_equal_trees(a["fused"], b["fused"])  # row-wise AdaGrad's sums


def test_a_damaged_middle_delta_falls_back_to_the_valid_prefix_and_names_the_file(chain_run, tmp_path, uninterrupted_dlrm):
    ckpt = copied_chain(chain_run, tmp_path)
    damaged = step_dir(ckpt, 4) / DELTA_FILE.format(rank=1)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    damaged.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fmt.newest_complete(ckpt) == step_dir(ckpt, 2)  # 7 and 6 build on 4; 4 is damaged; 2 is whole
    said = [str(w.message) for w in caught]
    assert len(said) == 3 and all(DELTA_FILE.format(rank=1) in s for s in said), said
    full, _ = uninterrupted_dlrm
    resumed = run_job(tmp_path / "second", "--max-steps", "12", *CHAIN, "--ckpt-dir", str(ckpt))
    for a, b in zip(full, resumed, strict=True):
        assert len(b["losses"]) == 10  # from step 2
        assert_equal_trees(a["model"], b["model"])
        assert_equal_trees(a["fused"], b["fused"])


def whole(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A checkpoint's tables and fused optimizer state gathered whole in this process (a chain: full + deltas)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, fused = read_whole(path, "model"), read_whole(path, "fused")["state"]
    return {"model": model, "fused": {f"{p}.{k}": v for p, states in fused.items() for k, v in states.items()}}


def assert_holds(local: dict[str, object], whole: dict[str, torch.Tensor]) -> int:
    """Every local shard a rank reported (ett_job.py's ``name@offsets`` for 1D, DTensors over local shards for 2D)
    equals that block of the whole tensor; returns how many blocks were compared."""
    compared = 0
    for key, value in local.items():
        name, _, offsets = key.partition("@")
        inner = getattr(value, "_local_tensor", None)
        if offsets:
            blocks = [(value, tuple(int(o) for o in offsets.strip("()").split(",") if o.strip()))]
        elif inner is not None and hasattr(inner, "local_shards"):
            blocks = list(zip(inner.local_shards(), (tuple(o) for o in inner.local_offsets())))
        else:
            blocks = [(inner if inner is not None else value, (0,) * value.dim())]
        for block, at in blocks:
            assert torch.equal(whole[name][tuple(slice(o, o + n) for o, n in zip(at, block.shape))], block), key
            compared += 1
    return compared


def load_only(out: Path, source: Path, devices: int, *args: str) -> list[dict]:
    """Restore ``source`` and stop (max_steps = its step): each rank's facts are what it restored."""
    step = str(fmt.read_meta(source)["global_step"]) if (source / fmt.META_FILE).is_file() else "7"
    proc = launch(str(SCRIPTS / "ett_job.py"), "--out", str(out), "--devices", str(devices), "--max-steps", step,
                  "--resume", str(source), *args, run_dir=out / "ett", devices=devices, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "was saved with fused_optimizer" not in proc.stdout + proc.stderr  # the same optimizer: nothing said
    return rank_facts(out)


def test_a_chain_holds_exactly_what_a_full_save_of_the_same_step_holds(chain_run):
    chain, ref = whole(step_dir(chain_run / "ckpt", 7)), whole(chain_run / "ref")
    assert assert_equal_trees(ref, chain) >= 12


def test_a_chain_written_by_two_ranks_restores_on_one_rank(chain_run, tmp_path):
    (facts,) = load_only(tmp_path, step_dir(chain_run / "ckpt", 7), 1)
    ref = whole(chain_run / "ref")
    assert facts["global_step"] == 7
    assert assert_holds(facts["model"], ref["model"]) >= 4 and assert_holds(facts["fused"], ref["fused"]) >= 4


def test_2d_table_wise_writes_its_deltas_once_per_shard_and_a_1d_chain_restores_into_2d_row_wise(chain_run, tmp_path):
    # 2D (4 ranks, groups of 2, table-wise: each rank holds no shard of the tables its group peer holds): its chain
    # equals its full save of the same step...
    assert_2d_chain_equals_its_full_save(tmp_path / "2d", "table_wise")
    # ... and the 1D chain (2 ranks, table-wise) restores into a 2D row-wise layout as its full save would.
    facts = load_only(tmp_path / "load", step_dir(chain_run / "ckpt", 7), 4, "--sharding-type", "row_wise",
                      "--sharding-group-size", "2")
    ref = whole(chain_run / "ref")
    for rank in facts:
        assert assert_holds(rank["model"], ref["model"]) >= 4 and assert_holds(rank["fused"], ref["fused"]) >= 4


def test_2d_row_wise_writes_its_deltas_once_per_shard(tmp_path):
    # Row-wise in 2D: each rank of a group holds a row block of every table, and its replica peer the same block.
    assert_2d_chain_equals_its_full_save(tmp_path, "row_wise")


def assert_2d_chain_equals_its_full_save(out: Path, sharding_type: str) -> None:
    layout = ["--sharding-type", sharding_type, "--sharding-group-size", "2"]
    proc = launch(str(SCRIPTS / "ett_job.py"), "--out", str(out), "--devices", "4", "--max-steps", "7", *layout,
                  *CHAIN,
                  "--ckpt-dir", str(out / "ckpt"), "--sync-ref-at", "7", run_dir=out / "ett", devices=4, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert manifest(step_dir(out / "ckpt", 7))["kind"] == "delta"
    assert assert_equal_trees(whole(out / "ref"), whole(step_dir(out / "ckpt", 7))) >= 12
    assert_each_row_written_once_per_shard(step_dir(out / "ckpt", 7))


def assert_each_row_written_once_per_shard(checkpoint: Path) -> None:
    """No row of a tensor's column block is in two ranks' files (2D replicas write their shard once)."""
    written: set[tuple] = set()
    for record in delta.read(checkpoint):
        for row in record.global_rows.tolist():
            assert (record.key, record.offsets[1:], row) not in written, (record.key, row)
            written.add((record.key, record.offsets[1:], row))
    assert written


def test_another_callbacks_growing_state_does_not_end_the_chain(tmp_path):
    # A stock ModelCheckpoint(monitor=..., save_top_k=-1) adds a tensor to Lightning's checkpoint data at every
    # save; the tables' buffers and the chain's base stay, so the saves are still deltas and still exact.
    ckpt = tmp_path / "ckpt"
    run_job(tmp_path / "job", "--max-steps", "7", *CHAIN, "--ckpt-dir", str(ckpt), "--top-k-dir", str(tmp_path / "mc"),
            "--sync-ref-at", "7")
    kinds = [manifest(step_dir(ckpt, step)).get("kind", "full") for step in (2, 4, 6)]
    assert kinds == ["full", "delta", "delta"], kinds
    assert len(list((tmp_path / "mc").glob("*.ckpt"))) >= 3  # the other callback saved too
    assert manifest(step_dir(ckpt, 7))["kind"] == "delta"
    assert assert_equal_trees(whole(tmp_path / "job" / "ref"), whole(step_dir(ckpt, 7))) >= 12


def test_row_wise_tables_with_per_element_adagrad_resume_exactly_from_a_chain(tmp_path):
    args = ["--sharding-type", "row_wise", "--fused-optimizer", "adagrad"]  # state as wide as the rows (as Adam's)
    full = run_job(tmp_path / "full", "--max-steps", "10", *args)
    ckpt = tmp_path / "ckpt"
    run_job(tmp_path / "first", "--max-steps", "5", *args, *CHAIN, "--ckpt-dir", str(ckpt))
    assert manifest(step_dir(ckpt, 5))["kind"] == "delta"
    resumed = run_job(tmp_path / "second", "--max-steps", "10", *args, *CHAIN, "--ckpt-dir", str(ckpt))
    for a, b in zip(full, resumed, strict=True):
        assert len(b["losses"]) == 5
        assert_equal_trees(a["model"], b["model"])
        assert assert_equal_trees(a["fused"], b["fused"]) >= 2


def test_a_kill_while_a_delta_is_written_leaves_nothing_complete_and_the_restart_resumes_from_the_last_commit(
        tmp_path, uninterrupted_dlrm):
    # Deltas are held 3 s between their data files (every rank's, agreed) and rank 0's commit; saves due meanwhile
    # are skipped. Rank 0 is killed at the first step from 8 on at which a delta is in flight with its rows on disk
    # (the delta of step 4 on a quick host; a later one on a slow host that finished it): all its data is on disk,
    # its manifest is not. (Had rank 0 lived, it would rightly have committed it: every rank had written its part.)
    # Steps sleep 0.1 s, so the first, full save is committed before step 8 however quick the steps are (on a host
    # where steps outran it, it was still in flight at step 10 and the only delta was the final, blocking one).
    ckpt = tmp_path / "ckpt"
    proc = launch(str(SCRIPTS / "ett_job.py"), "--out", str(tmp_path), "--max-steps", "12", *CHAIN, "--when-busy", "skip",
                  "--ckpt-dir", str(ckpt), "--kill-at", "8", "--kill-rank", "0", "--kill-when-writing", "--step-sleep", "0.1",
                  run_dir=tmp_path / "ett", max_restarts=1,
                  LIGHTNING_ETT_FAULT_WRITE_DELAY_S="3", LIGHTNING_ETT_FAULT_WRITE_DELAY_KIND="delta")
    assert proc.returncode == 0, proc.stderr[-4000:]
    first, second = ("".join(p.read_text() for p in (tmp_path / "ett").glob(f"worker_logs/**/attempt_{a}/0/std*.log"))
                     for a in (0, 1))
    unfinished = re.findall(r"deleted the unfinished '[^']*step-(\d+)\.tmp'", second)  # the delta in flight
    committed = [int(s) for s in re.findall(r"AsyncCheckpoint: step (\d+) is durable at", first)]
    assert len(unfinished) == 1 and committed and int(unfinished[0]) > max(committed), (first[-3000:], second[-3000:])
    assert f"resuming from the newest complete checkpoint {step_dir(ckpt, max(committed))}\n" in second
    full, _ = uninterrupted_dlrm
    for a, b in zip(full, rank_facts(tmp_path), strict=True):
        assert b["global_step"] == 12 and len(b["losses"]) == 12 - max(committed)
        assert_equal_trees(a["model"], b["model"])
        assert_equal_trees(a["fused"], b["fused"])


def test_a_job_killed_mid_run_resumes_from_full_plus_deltas_and_ends_as_an_uninterrupted_run(tmp_path, uninterrupted_dlrm):
    # The acceptance case: rank 1 is SIGKILLed at step 9 of the first attempt; `lightning run` restarts the job,
    # which resumes by itself from the newest delta (full save 2, deltas 4, 6 and 8 unless 8 was still being written).
    ckpt = tmp_path / "ckpt"
    proc = launch(str(SCRIPTS / "ett_job.py"), "--out", str(tmp_path), "--max-steps", "12", *CHAIN, "--ckpt-dir", str(ckpt),
                  "--kill-at", "9", run_dir=tmp_path / "ett", max_restarts=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first, second = ("".join(p.read_text() for p in (tmp_path / "ett").glob(f"worker_logs/**/attempt_{a}/0/std*.log"))
                     for a in (0, 1))
    (resumed,) = re.findall(r"resuming from the newest complete checkpoint \S*step-0*(\d+)\n", second)
    # 6 is a delta, logged before the kill (the save of 8 waited for it); 8, if committed, is the next delta of that
    # chain (full_every_n_saves=10), though rank 0 may have been stopped before it logged it
    assert int(resumed) in (6, 8) and f"step 6 is durable at {step_dir(ckpt, 6)} (a delta" in first
    full, _ = uninterrupted_dlrm
    for a, b in zip(full, rank_facts(tmp_path), strict=True):
        assert b["global_step"] == 12 and len(b["losses"]) == 12 - int(resumed)
        assert a["losses"][int(resumed):] == b["losses"]
        assert_equal_trees(a["model"], b["model"])
        assert_equal_trees(a["fused"], b["fused"])


def test_a_chain_saved_under_row_wise_adagrad_resumes_under_sgd_naming_the_state_it_drops(chain_run, tmp_path):
    def resume(name: str, ckpt: Path, steps: int, *args: str) -> subprocess.CompletedProcess[str]:
        return launch(str(SCRIPTS / "ett_job.py"), "--out", str(tmp_path / name), "--max-steps", str(steps), *CHAIN,
                      "--ckpt-dir", str(ckpt), *args, run_dir=tmp_path / name / "ett")

    # Resumed with the optimizer it was saved with: nothing is left behind, nothing is said.
    same = resume("same", copied_chain(chain_run, tmp_path / "a"), 8)
    assert same.returncode == 0, same.stderr[-4000:]
    assert "was saved with fused_optimizer" not in same.stdout + same.stderr
    # Under SGD, which keeps no state: row-wise AdaGrad's sums cannot be restored, and the user is told, once.
    sgd = resume("sgd", copied_chain(chain_run, tmp_path / "b"), 8, "--fused-optimizer", "sgd")
    assert sgd.returncode == 0, sgd.stderr[-4000:]
    said = "was saved with fused_optimizer='row_wise_adagrad'; its embedding optimizer state is left behind (SGD keeps none)"
    assert (sgd.stdout + sgd.stderr).count(said) == 1, sgd.stderr[-3000:]
    assert all(facts["global_step"] == 8 for facts in rank_facts(tmp_path / "sgd"))
    # Under element-wise AdaGrad, whose state means something else: refused on every rank, naming both and the fix.
    adagrad = resume("adagrad", copied_chain(chain_run, tmp_path / "c"), 8, "--fused-optimizer", "adagrad")
    assert adagrad.returncode != 0
    refused = ("ETTStrategy(fused_optimizer='adagrad'): the checkpoint {!r} was saved with "
               "fused_optimizer='row_wise_adagrad', whose embedding optimizer state does not carry over to 'adagrad'")
    ckpt7 = str(step_dir(tmp_path / "c" / "ckpt", 7))
    assert refused.format(ckpt7) in adagrad.stderr, adagrad.stderr[-3000:]
    assert "Resume with ETTStrategy(fused_optimizer='row_wise_adagrad'); or, to leave that state behind" in adagrad.stderr
    # Back from SGD's checkpoint (step 8, saved under sgd) to row-wise AdaGrad: nothing to lose, its sums start at zero.
    back = resume("back", tmp_path / "b" / "ckpt", 10)
    assert back.returncode == 0, back.stderr[-4000:]
    fresh = "was saved with fused_optimizer='sgd', which keeps no state: row_wise_adagrad's embedding optimizer state starts"
    assert (back.stdout + back.stderr).count(fresh) == 1, back.stderr[-3000:]
    assert all(facts["global_step"] == 10 and len(facts["losses"]) == 2 for facts in rank_facts(tmp_path / "back"))


#: Saves every step of a model with 20,000-row tables and 16 ids a step, whose chains reach the restore bound in a
#: few deltas (``--chain-bound``): a full save at 1, deltas 2-5, a rebase at 6 (every row changed since 1), a delta.
REBASING = ["--async-every", "1", "--incremental", "--when-busy", "wait", "--chain-bound", "0.02", "--rows", "20000",
            "--batch", "16"]


def test_a_rebase_builds_on_the_full_save_alone_and_a_resume_from_its_chain_matches_an_uninterrupted_run(tmp_path):
    full = run_job(tmp_path / "full", "--max-steps", "11", *REBASING, "--ckpt-dir", str(tmp_path / "full-ckpt"))
    ckpt = tmp_path / "ckpt"
    run_job(tmp_path / "first", "--max-steps", "7", *REBASING, "--async-keep", "2", "--ckpt-dir", str(ckpt))
    assert manifest(step_dir(ckpt, 6))["rebase"] and not manifest(step_dir(ckpt, 7))["rebase"]
    assert [link["name"] for link in manifest(step_dir(ckpt, 6))["chain"]] == [fmt.checkpoint_name(1)]
    assert [link["name"] for link in manifest(step_dir(ckpt, 7))["chain"]] == [fmt.checkpoint_name(s) for s in (1, 6)]
    # keep_last_n=2: 6 and 7 rest on the rebase, so 5 (on the full save) stays too, with its chain: a damaged rebase
    # sends a resume back one save. The next rebase would let 2-5 go.
    assert [e.step for e in fmt.committed(ckpt)] == [1, 2, 3, 4, 5, 6, 7]
    rebase_rows = sum(len(r.global_rows) for r in delta.read(step_dir(ckpt, 6)))
    delta_rows = sum(len(r.global_rows) for r in delta.read(step_dir(ckpt, 7)))
    assert rebase_rows > 3 * delta_rows  # the rows of 5 intervals
    resumed = run_job(tmp_path / "second", "--max-steps", "11", *REBASING, "--async-keep", "2", "--ckpt-dir", str(ckpt))
    for a, b in zip(full, resumed, strict=True):
        assert b["global_step"] == 11 and len(b["losses"]) == 4  # resumed at the delta of step 7
        assert a["losses"][7:] == b["losses"]
        assert_equal_trees(a["model"], b["model"])
        assert_equal_trees(a["fused"], b["fused"])  # row-wise AdaGrad's sums


def test_a_rebase_chain_under_per_element_adagrad_holds_what_a_full_save_of_the_same_step_holds(tmp_path):
    # Row-wise tables with state as wide as their rows (as Adam's): full 1, deltas 2-6, a rebase at 7, a delta at 8.
    out = tmp_path / "job"
    run_job(out, "--max-steps", "8", *REBASING, "--sharding-type", "row_wise", "--fused-optimizer", "adagrad",
            "--ckpt-dir", str(out / "ckpt"), "--sync-ref-at", "8")
    assert manifest(step_dir(out / "ckpt", 7))["rebase"]
    assert [link["name"] for link in manifest(step_dir(out / "ckpt", 8))["chain"]] == [
        fmt.checkpoint_name(s) for s in (1, 7)]
    assert assert_equal_trees(whole(out / "ref"), whole(step_dir(out / "ckpt", 8))) >= 8


def test_2d_a_rebase_writes_each_row_once_per_shard_and_its_chain_holds_what_a_full_save_holds(tmp_path):
    # 4 ranks, groups of 2, row-wise: full 1, deltas 2-4, a rebase at 5, a delta at 6 (a looser bound: 4 ranks'
    # deltas are larger next to the full save).
    out = tmp_path / "2d"
    proc = launch(str(SCRIPTS / "ett_job.py"), "--out", str(out), "--devices", "4", "--max-steps", "6",
                  "--sharding-type", "row_wise", "--sharding-group-size", "2", *REBASING, "--chain-bound", "0.04",
                  "--ckpt-dir", str(out / "ckpt"), "--sync-ref-at", "6", run_dir=out / "ett", devices=4, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert manifest(step_dir(out / "ckpt", 5))["rebase"]
    assert [link["name"] for link in manifest(step_dir(out / "ckpt", 6))["chain"]] == [
        fmt.checkpoint_name(s) for s in (1, 5)]
    assert assert_equal_trees(whole(out / "ref"), whole(step_dir(out / "ckpt", 6))) >= 12
    assert_each_row_written_once_per_shard(step_dir(out / "ckpt", 5))
