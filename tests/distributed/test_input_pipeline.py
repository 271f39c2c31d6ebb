"""ETTStrategy's pipelined sparse input distribution (#33) on real gloo ranks: the same training as the plain schedule.

Fits run in two launches of tests/scripts/pipeline_job.py: a pipelined and an unpipelined fit of each
case one after the other in the same 2 processes, and the 2D cases on 4. A pipelined fit must equal its
unpipelined twin bit for bit (losses and every tensor each rank holds at the end), and must actually
have used distributions started a step ahead (``pipelined_calls``): equality alone would also hold for
a pipeline that never engaged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, launch

from lightning_ett.instrument.ledger import read_ledger
from lightning_ett.instrument.timeline import GC_FREEZE_FACT

JOB = str(SCRIPTS / "pipeline_job.py")
STEPS = 50
#: Pipelined forwards in a fit of n batches in one epoch: the first batch is observed (which
#: modules take which part of the batch), the second was fetched before that was known.
def pipelined_in(batches: int) -> int:
    return batches - 2


CASES = {  # name -> the fit's spec; each runs pipelined and not
    "plain": {"steps": STEPS},
    "validation": {"steps": 30, "val_every": 7},
    "accumulate": {"steps": 15, "accumulate": 2},  # 30 batches
    "manual": {"steps": 30, "manual": True},
    "finite": {"finite": 50, "epochs": 2},  # 50 samples per rank in 16s: 16, 16, 16, 2 per epoch
    "bf16": {"steps": 20, "precision": "bf16-mixed"},
    "row_wise": {"steps": 20, "sharding_type": "row_wise"},
    # Its input_dist fills the KJT's weights in place before sending them (TorchRec's own unpipelined path): once
    # refused as ids changed after they were sent.
    "position_weighted_row_wise": {"steps": 12, "sharding_type": "row_wise", "variant": "position_weighted"},
}


def load(out: Path, name: str, ranks: int = 2) -> list[dict]:
    return [torch.load(out / name / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pipeline")
    plan = [{"name": f"{name}-{'piped' if on else 'plain'}", "pipeline": on, **spec}
            for name, spec in CASES.items() for on in (False, True)]
    plan += [{"name": "saved", "pipeline": True, "steps": 30, "save_at": 12},
             {"name": "resumed", "pipeline": True, "steps": 30, "resume": "saved"}]
    plan += [{"name": f"callbacks-{'piped' if on else 'plain'}", "pipeline": on, "steps": 24, "callbacks": True}
             for on in (False, True)]
    plan += [{"name": "callbacks-resumed", "pipeline": True, "steps": 24, "callbacks": True,
              "resume_path": "callbacks-piped/async/step-000000010"},
             {"name": "callbacks-finite", "pipeline": True, "finite": 50, "epochs": 2, "callbacks": True}]
    plan += [{"name": f"{variant}-{'piped' if on else 'plain'}", "pipeline": on, "steps": 12, "variant": variant}
             for variant in ("rebuilt_kjt", "before_transfer", "dataloader_iter", "rank1_rebuilds", "after_transfer_step")
             for on in (False, True)]
    plan += [{"name": f"stateful_sized-{'piped' if on else 'plain'}", "pipeline": on, "finite": 50,
              "variant": "stateful_sized"} for on in (False, True)]
    plan += [{"name": f"none_at-{'piped' if on else 'plain'}", "pipeline": on, "steps": 12, "none_at": 4}
             for on in (False, True)]
    plan += [{"name": f"inplace_ids-{'piped' if on else 'plain'}", "pipeline": on, "steps": 8, "variant": "inplace_ids",
              "expect_error": True} for on in (False, True)]
    plan += [{"name": "gc_off-piped", "pipeline": True, "steps": 12, "gc_freeze": False}]
    proc = launch(JOB, "--out", str(out), "--fits", json.dumps(plan), run_dir=out / "run", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (out / "log").write_text(proc.stdout + proc.stderr)
    return out


@pytest.fixture(scope="module")
def fits_2d(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pipeline-2d")
    plan = [{"name": f"{kind}-{'piped' if on else 'plain'}", "pipeline": on, "steps": 20, "k": 2, "sharding_type": kind}
            for kind in ("table_wise", "row_wise") for on in (False, True)]
    proc = launch(JOB, "--out", str(out), "--devices", "4", "--fits", json.dumps(plan), run_dir=out / "run", devices=4,
                  timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def assert_same_training(plain: list[dict], piped: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(plain, piped, strict=True)):
        assert a["losses"] == b["losses"], rank
        assert a["end"].keys() == b["end"].keys()
        for key, value in a["end"].items():
            assert torch.equal(value, b["end"][key]), (rank, key)


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_training_equals_the_plain_schedule_bit_for_bit(fits, case):
    plain, piped = load(fits, f"{case}-plain"), load(fits, f"{case}-piped")
    assert_same_training(plain, piped)
    batches = len(piped[0]["losses"])
    expected = {"finite": pipelined_in(4) + (4 - 1)}.get(case, pipelined_in(batches))  # epoch 2: no first-batch observing
    for facts in piped:
        assert facts["off_reason"] is None
        assert facts["pipelined_calls"] == expected, (case, facts["pipelined_calls"])
    for facts in plain:
        assert facts["pipelined_calls"] == 0


def test_the_last_batch_of_each_epoch_is_trained_short_and_nothing_is_left_prepared(fits):
    for facts in load(fits, "finite-piped"):
        assert facts["batch_sizes"] == [16, 16, 16, 2] * 2
        # batches 3 and 4 of epoch 1, 2 to 4 of epoch 2: none past the end of an epoch
        assert facts["prepared_batches"] == 5


def test_a_checkpoint_taken_mid_pipeline_resumes_exactly(fits):
    uninterrupted, resumed = load(fits, "plain-piped"), load(fits, "resumed")
    for rank, (a, b) in enumerate(zip(uninterrupted, resumed, strict=True)):
        assert b["losses"] == a["losses"][13:30], rank  # saved after batch 12: the resumed fit trains 13..29
        assert b["pipelined_calls"] == pipelined_in(17)
    saved_30 = load(fits, "saved")
    for a, b in zip(saved_30, resumed, strict=True):  # the saved fit ran on to 30 uninterrupted
        for key, value in a["end"].items():
            assert torch.equal(value, b["end"][key]), key


def test_monitor_async_checkpoint_dynamic_shapes_and_compile_cache_work_under_the_pipeline(fits):
    """The callbacks together, the dense parts compiled: the same training, every step in ETTMonitor's ledger,
    AsyncCheckpoint's saves complete and one of them resumed exactly, no recompile for an epoch's short last batch."""
    plain, piped = load(fits, "callbacks-plain"), load(fits, "callbacks-piped")
    assert_same_training(plain, piped)
    assert all(facts["pipelined_calls"] == pipelined_in(24) for facts in piped)
    # the job's ledger holds the callback fits' steps in order: plain, pipelined, resumed after step 10, finite
    expected = [*range(24), *range(24), *range(10, 24), *range(8)]
    for ledger in read_ledger(fits / "run"):
        assert [e["step"] for e in ledger.events if e["phase"] == "train"] == expected, ledger.rank
    saves = sorted(p.name for p in (fits / "callbacks-piped" / "async").glob("step-*"))
    assert saves == ["step-000000010", "step-000000020", "step-000000024"]
    for a, b in zip(piped, load(fits, "callbacks-resumed"), strict=True):  # resumed after step 10: 11..24 again
        assert b["losses"] == a["losses"][10:]
        for key, value in a["end"].items():
            assert torch.equal(value, b["end"][key]), key
    finite = load(fits, "callbacks-finite")
    assert all(facts["batch_sizes"] == [16, 16, 16, 2] * 2 and facts["recompiles"] == 0 for facts in finite)
    assert all(facts["pipelined_calls"] == pipelined_in(4) + (4 - 1) for facts in finite)


@pytest.mark.parametrize(("variant", "reason"), [
    ("rebuilt_kjt", None),  # pipelining is decided per module: this one takes a KJT made in forward
    ("rank1_rebuilds", None),  # ... on one rank only: no rank pipelines it (they agree once per fit)
    ("before_transfer", "on_before_batch_transfer"),
    ("dataloader_iter", "dataloader_iter"),  # the user fetches: nothing to prepare
    ("stateful_sized", None),  # not read ahead: its saved state would count the batch read ahead
])
def test_what_cannot_be_pipelined_trains_as_before(fits, variant, reason):
    plain, piped = load(fits, f"{variant}-plain"), load(fits, f"{variant}-piped")
    assert_same_training(plain, piped)
    for facts in piped:
        assert facts["pipelined_calls"] == 0 and facts["prepared_batches"] == 0
        assert (facts["off_reason"] is None) if reason is None else (reason in facts["off_reason"])


def test_the_modules_that_are_not_pipelined_are_named_once(fits):
    log = (fits / "log").read_text()
    assert log.count("input distribution is not pipelined: model.sparse_arch.embedding_bag_collection "
                     "(input made in forward)") == 1
    assert log.count("embedding_bag_collection (its input was not found in another rank's batch)") == 1
    assert log.count("BeforeTransfer overrides on_before_batch_transfer") == 1
    assert log.count("the training loader is sized and stateful") == 1


def test_on_after_batch_transfer_runs_when_the_loop_would_run_it(fits):
    """A hook that depends on the step sees the step of the batch it transfers, pipelined or not."""
    plain, piped = load(fits, "after_transfer_step-plain"), load(fits, "after_transfer_step-piped")
    assert_same_training(plain, piped)
    assert all(facts["pipelined_calls"] == pipelined_in(12) for facts in piped)


def test_a_none_batch_is_skipped_as_lightning_skips_it(fits):
    plain, piped = load(fits, "none_at-plain"), load(fits, "none_at-piped")
    assert_same_training(plain, piped)
    assert all(facts["pipelined_calls"] == pipelined_in(12) - 1 for facts in piped)  # batch 5 was not prepared


def test_ids_changed_in_place_after_they_were_sent_are_refused_not_trained_on(fits):
    for facts in load(fits, "inplace_ids-plain"):
        assert facts["error"] is None and len(facts["losses"]) == 8
    for facts in load(fits, "inplace_ids-piped"):
        assert "were changed in place after they were sent" in facts["error"]
        assert len(facts["losses"]) == 2  # the first pipelined batch (the third) is refused before its loss


@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_2d_pipelined_training_equals_the_plain_schedule(fits_2d, kind):
    plain, piped = load(fits_2d, f"{kind}-plain", 4), load(fits_2d, f"{kind}-piped", 4)
    assert_same_training(plain, piped)
    for facts in piped:
        assert facts["pipelined_calls"] == pipelined_in(20)


def test_start_up_objects_are_frozen_while_training_and_unfrozen_when_the_fit_ends(fits):
    """ETTStrategy(gc_freeze=True), the default, in every fit of this module (its fits run here for their number):
    start-up's objects frozen at every training batch and until the fit's teardown, which unfreezes them; a fit that
    failed in training (inplace_ids-piped) is unfrozen by on_exception already."""
    names = [d.name for d in fits.iterdir() if (d / "rank0.pt").exists()]
    assert len(names) > 30 and "inplace_ids-piped" in names
    for name in names:
        for facts in load(fits, name):
            assert facts["frozen_after"] == 0, name
            if name == "gc_off-piped":
                assert facts["frozen_in_training"] == (0, 0) and facts["frozen_at_teardown"] == 0  # left alone
            elif facts["error"] is not None:
                assert facts["frozen_at_teardown"] == 0, name  # on_exception unfroze
            elif facts["losses"]:  # (a fit refused before its first batch never reaches the hook)
                fewest, _ = facts["frozen_in_training"]  # (frozen objects freed by reference counting leave the count)
                assert fewest > 50_000 and facts["frozen_at_teardown"] > 50_000, name  # ~400k: Lightning + TorchRec
    # in the ledger (bound at the first fit with ETTMonitor, callbacks-plain): each later fit's freeze, every rank
    for ledger in read_ledger(fits / "run"):
        frozen = [f for f in ledger.facts if f["name"] == GC_FREEZE_FACT]
        assert len(frozen) >= 4 and all(f["objects"] > 50_000 and 0 < f["seconds"] < 30 for f in frozen), ledger.rank

