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


CONCAT_JOB = """
import json, sys, torch
from lightning.pytorch import LightningModule, Trainer
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader
from lightning_ett import DynamicShapes

class MLP(torch.nn.Module):  # (nn.Sequential.compile() compiles nothing in torch 2.13)
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

class ConcatModel(LightningModule):  # a compiled MLP fed what eager code computed from the batch
    def __init__(self, style):
        super().__init__()
        self.emb, self.mlp = torch.nn.Embedding(100, 4), MLP()
        if style == "module.compile":
            self.mlp.compile(backend="aot_eager")
        else:
            self.mlp = torch.compile(self.mlp, backend="aot_eager")

    def training_step(self, batch, batch_idx):
        dense, ids = batch
        return self.mlp(torch.cat([dense[:, :4], self.emb(ids)], dim=1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def frames_compiled(style, callbacks):
    torch._dynamo.reset()  # (Dynamo's memory of the sizes a frame saw would make the second arm dynamic by itself)
    before = counters["frames"]["ok"]
    n = 64 * 3 + 40  # the last batch holds 40
    data = DataLoader(list(zip(torch.randn(n, 8), torch.randint(0, 100, (n,)))), batch_size=64)
    trainer = Trainer(accelerator="cpu", max_epochs=1, callbacks=callbacks, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(ConcatModel(style), data)
    assert trainer.global_step == 4
    return counters["frames"]["ok"] - before

result = {}
for style in ("module.compile", "torch.compile(module)"):
    callback = DynamicShapes()
    result[style] = [frames_compiled(style, []), frames_compiled(style, [callback]), len(callback._wrapped)]
print(json.dumps(result))
"""


def test_a_compiled_module_fed_computed_tensors_does_not_recompile_at_a_smaller_last_batch():
    proc = run_script("-c", CONCAT_JOB, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # Frames compiled without DynamicShapes (the control: specialized on 64, compiled again for 40), with it, and
    # the compiled modules still wrapped after fit (none: taken off at teardown).
    assert result == {"module.compile": [2, 1, 0], "torch.compile(module)": [2, 1, 0]}, result


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
