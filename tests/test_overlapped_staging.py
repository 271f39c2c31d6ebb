"""AsyncCheckpoint copies parameters and optimizer states while the next step runs: still the due step's state, bit for bit."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, IterableDataset

from lightning_ett import AsyncCheckpoint
from lightning_ett.checkpoint import layout as fmt
from lightning_ett.checkpoint.staging import Stager, storages


class Steps(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            yield 0


class Net(LightningModule):
    """BatchNorm's running statistics change in forward; Adam's state and the weights in the optimizer step."""

    def __init__(self, mutate_in_forward: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.mutate_in_forward = mutate_in_forward
        self.checkpoint: AsyncCheckpoint | None = None
        self.forward_while_copying: list[int] = []  # steps whose forward ran while a snapshot's copy was in flight

    def training_step(self, _batch, batch_idx):  # type: ignore[no-untyped-def]
        snapshot = self.checkpoint._snapshot if self.checkpoint is not None else None
        if snapshot is not None and snapshot.copying:
            self.forward_while_copying.append(self.global_step)
        if self.mutate_in_forward:
            with torch.no_grad():
                self.scale.mul_(0.5)  # an in-place update in forward: not the state at the previous step
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(self.global_step))
        return (self.net(x) * self.scale).pow(2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Reference(Callback):
    """Deep copies of the model and optimizer state at the end of the given steps (before AsyncCheckpoint runs)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps
        self.states: dict[int, dict[str, Any]] = {}

    def on_train_batch_end(self, trainer, pl_module, *args):  # type: ignore[no-untyped-def]
        if trainer.global_step in self.steps:
            self.states[trainer.global_step] = copy.deepcopy(
                {"model": pl_module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()})


def fit(tmp_path: Path, model: Net, steps: int, every: int, reference_at: set[int]) -> tuple[AsyncCheckpoint, Reference]:
    checkpoint = AsyncCheckpoint(tmp_path / "ckpt", every_n_train_steps=every, keep_last_n=None, resume=False,
                                 when_busy="wait")
    model.checkpoint = checkpoint
    reference = Reference(reference_at)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[reference, checkpoint], logger=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(Steps(), batch_size=None))
    return checkpoint, reference


def assert_saved_state_is(path: Path, expected: dict[str, Any]) -> None:
    saved = fmt.load_unsharded(path)
    assert saved["state_dict"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        assert torch.equal(saved["state_dict"][name], value), name
    [optimizer] = saved["optimizer_states"]
    assert optimizer["state"].keys() == expected["optimizer"]["state"].keys()
    for index, state in expected["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(optimizer["state"][index][key], value), (index, key)


def test_the_next_forward_runs_while_the_copy_is_in_flight_and_the_saved_tensors_are_the_due_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_ETT_FAULT_STAGE_DELAY_S", "0.5")  # the late copy starts 0.5 s after the boundary
    model = Net()
    _, reference = fit(tmp_path, model, steps=6, every=4, reference_at={4})
    assert 5 in [step + 1 for step in model.forward_while_copying]  # step 5's forward (global_step 4) ran mid-copy
    assert [e.step for e in fmt.committed(tmp_path / "ckpt")] == [4, 6]
    # Step 5's forward changed BatchNorm's running statistics and its optimizer step every weight and Adam's
    # moments; the checkpoint of step 4 still holds step 4's values of all of them.
    assert_saved_state_is(tmp_path / "ckpt" / fmt.checkpoint_name(4), reference.states[4])
    final = fmt.load_unsharded(tmp_path / "ckpt" / fmt.checkpoint_name(6))
    assert not torch.equal(final["state_dict"]["net.1.running_mean"], reference.states[4]["model"]["net.1.running_mean"])


def test_a_parameter_changed_in_forward_voids_the_snapshot_and_the_next_step_is_saved(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_ETT_FAULT_STAGE_DELAY_S", "0.3")
    model = Net(mutate_in_forward=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint, reference = fit(tmp_path, model, steps=10, every=4, reference_at={5, 8})
    dropped = [str(w.message) for w in caught if "changed before the snapshot" in str(w.message)]
    assert len(dropped) == 1 and "scale" in dropped[0] and "step 5 is saved instead" in dropped[0], dropped
    # Step 4's snapshot was never committed; step 5 was saved instead, and from then on `scale` is copied at the
    # boundary, so the save of step 8 is exact although the next forward changes it again.
    assert [e.step for e in fmt.committed(tmp_path / "ckpt")] == [5, 8, 10]
    assert not list((tmp_path / "ckpt").glob("*.tmp"))
    assert_saved_state_is(tmp_path / "ckpt" / fmt.checkpoint_name(5), reference.states[5])
    assert_saved_state_is(tmp_path / "ckpt" / fmt.checkpoint_name(8), reference.states[8])
    assert checkpoint.saves == 3


def test_overlap_staging_false_copies_everything_at_the_boundary(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_ETT_FAULT_STAGE_DELAY_S", "0.3")
    model = Net(mutate_in_forward=True)
    checkpoint = AsyncCheckpoint(tmp_path / "ckpt", every_n_train_steps=4, resume=False, overlap_staging=False)
    model.checkpoint = checkpoint
    reference = Reference({4})
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[reference, checkpoint], logger=False,
                      enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(Steps(), batch_size=None))
    assert not [w for w in caught if "changed before the snapshot" in str(w.message)]
    assert model.forward_while_copying == []  # nothing left to copy after the boundary
    assert_saved_state_is(tmp_path / "ckpt" / fmt.checkpoint_name(4), reference.states[4])
    with pytest.raises(TypeError, match="overlap_staging='yes'"):
        AsyncCheckpoint(tmp_path, every_n_train_steps=4, overlap_staging="yes")  # type: ignore[arg-type]


def test_the_stager_copies_late_only_what_it_is_told_and_names_what_changed_too_early():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    stager = Stager()
    snapshot = stager.stage({"model": model.state_dict(), "step": 3}, late_storages=storages([list(model.parameters())]))
    staged = snapshot.state["model"]
    assert torch.equal(staged["1.running_mean"], model[1].running_mean)  # a buffer: copied at the boundary
    assert not torch.equal(staged["0.weight"], model[0].weight)  # a parameter: not yet (its buffer is still zero)
    assert snapshot.copying
    with torch.no_grad():
        model[0].bias.add_(1.0)  # changed before the late copy ran
    snapshot.copy_late()
    snapshot.wait_copied()
    assert torch.equal(staged["0.weight"], model[0].weight)
    assert snapshot.settle() == ["model.0.bias"]
    assert snapshot.changed_storages == {model[0].bias.untyped_storage().data_ptr()}
    assert not snapshot.valid()
    again = stager.stage({"model": model.state_dict(), "step": 4}, late_storages=storages([list(model.parameters())]))
    again.copy_late()
    assert again.settle() == [] and again.valid() and again.state["step"] == 4
    assert again.state["model"]["0.bias"].data_ptr() == staged["0.bias"].data_ptr()  # the same buffers, reused


def test_buffers_are_kept_when_only_the_non_tensor_state_changes_shape():
    # AsyncCheckpoint's own state holds a history of save costs that grows with every save; the buffers
    # (and their pages, which cost ~0.2-0.8 s per GiB to fault in) must not be rebuilt for that.
    model = torch.nn.Linear(64, 64)
    stager = Stager()
    first = stager.stage({"model": model.state_dict(), "callbacks": {"costs": [0.5]}})
    second = stager.stage({"model": model.state_dict(), "callbacks": {"costs": [0.5, 0.7], "new": "key"}})
    assert second.state["model"]["weight"].data_ptr() == first.state["model"]["weight"].data_ptr()
    assert second.state["callbacks"] == {"costs": [0.5, 0.7], "new": "key"}
    third = stager.stage({"model": model.state_dict(), "extra": torch.zeros(3)})  # another tensor: rebuilt to fit
    assert torch.equal(third.state["extra"], torch.zeros(3)) and stager.nbytes == (64 * 64 + 64 + 3) * 4


def test_pinned_staging_falls_back_when_shared_memory_is_too_small(tmp_path):
    # CUDA stages into shared + pinned buffers; a container's small /dev/shm must not fail the save.
    import shutil

    from lightning_ett.checkpoint.staging import shared_memory_fits

    free = shutil.disk_usage(tmp_path).free
    assert shared_memory_fits(1024, where=str(tmp_path))
    with pytest.warns(UserWarning, match="do not fit .* --shm-size"):
        assert not shared_memory_fits(free * 2, where=str(tmp_path))
    assert not shared_memory_fits(1024, where=str(tmp_path / "missing"))
