"""DynamicShapes: recompiles measured with and without it (real torch.compile), batch marking, bad input."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest
import torch
from conftest import SCRIPTS, run_script
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_ett import DynamicShapes
from lightning_ett.callbacks.dynamic_shapes import mark_batch_dynamic
from lightning_ett.instrument.compile_events import compile_tracker
from lightning_ett.instrument.ledger import read_ledger

JOB = str(SCRIPTS / "compile_job.py")


def compile_counts(tmp_path, *flags: str) -> dict:
    # aot_eager: Dynamo's guards and recompiles are the backend's business only after tracing,
    # so the count is the same as with inductor (benchmarks/recompiles.py uses inductor), minus its C++ builds.
    proc = run_script(JOB, "--out", str(tmp_path), "--backend", "aot_eager", *flags, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "compile.json").read_text())


def test_a_varying_batch_stream_recompiles_without_and_not_with_dynamic_shapes(tmp_path):
    plain = compile_counts(tmp_path / "plain")
    marked = compile_counts(tmp_path / "marked", "--dynamic-shapes")
    assert plain["steps"] == marked["steps"] == 5  # batch sizes 512, 512, 300, 512, 177
    assert plain["recompiles"] > 0  # measured: Dynamo specialized on 512, then recompiled for 300
    assert marked["recompiles"] == 0 and marked["graphs"] == 1
    # Each compilation is an ETT `compile` phase; the counts reach the loggers.
    [ledger] = read_ledger(tmp_path / "marked" / "ett")
    assert any(e["phase"] == "compile" for e in ledger.events)
    with open(tmp_path / "marked" / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("compile/recompiles")]
    assert rows and float(rows[-1]["compile/recompiles"]) == 0 and float(rows[-1]["compile/graphs"]) == 1


@dataclasses.dataclass
class RecBatch:
    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor


def rec_batch(batch: int) -> RecBatch:
    lengths = torch.randint(1, 4, (2 * batch,), dtype=torch.int32)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=torch.randint(0, 100, (int(lengths.sum()),)),
                                              lengths=lengths)
    return RecBatch(torch.randn(batch, 8), kjt, torch.rand(batch))


def test_batches_with_jagged_features_are_marked_and_do_not_recompile():
    tracker = compile_tracker()

    @torch.compile(backend="aot_eager")
    def pooled(dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return dense.sum(-1).mean() + values.float().mean() + lengths.float().mean()

    before = tracker.recompiles
    for size in (64, 64, 37, 64, 9):
        b = rec_batch(size)
        assert mark_batch_dynamic({"batch": b, "extra": [b.labels]}) == 5  # dense, values, lengths, labels x2
        pooled(b.dense, b.sparse.values(), b.sparse.lengths())
    assert tracker.recompiles == before


def test_a_frame_close_to_the_recompile_limit_is_named_in_a_warning():
    tracker = compile_tracker()
    callback = DynamicShapes()
    callback._tracker = tracker

    @torch.compile(backend="eager")
    def scaled(x: torch.Tensor, k: int) -> torch.Tensor:
        return x * k  # a Python int is a constant for Dynamo: each new value recompiles

    with torch._dynamo.config.patch(recompile_limit=3, automatic_dynamic_shapes=False):
        for k in range(3):
            scaled(torch.ones(2), k)
        with pytest.warns(UserWarning, match=r"compiled frame \d+ has been compiled 3 times; at .*recompile_limit=3"):
            callback._warn_near_limit()


@pytest.mark.parametrize(("kwargs", "message"), [({"batch_dim": -1}, "batch_dim=-1"),
                                                 ({"log_every_n_steps": 0}, "log_every_n_steps=0")])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicShapes(**kwargs)
