"""Dense optimizer state saved and loaded by parameter name (``lightning.pt``'s ``optimizer_states``)."""

from __future__ import annotations

import pytest
import torch

from lightning_ett.checkpoint.sharded import load_name_keyed_optimizer_state, name_keyed_optimizer_state
from lightning_ett.durable.errors import ConfigurationError


def trained(params: dict[str, torch.nn.Parameter], order: list[str]) -> torch.optim.Adam:
    optimizer = torch.optim.Adam([params[n] for n in order], lr=0.1)
    for step in range(3):
        optimizer.zero_grad()
        sum((i + 1) * (step + 1) * params[n].sum() for i, n in enumerate(order)).backward()
        optimizer.step()
    return optimizer


def names_of(params: dict[str, torch.nn.Parameter]) -> dict[int, str]:
    return {id(p): n for n, p in params.items()}


def test_state_lands_by_name_when_the_optimizer_lists_its_parameters_in_another_order():
    params = {n: torch.nn.Parameter(torch.zeros(i + 2)) for i, n in enumerate("ab")}
    saved = name_keyed_optimizer_state(trained(params, ["a", "b"]), names_of(params))
    fresh = {n: torch.nn.Parameter(torch.zeros(i + 2)) for i, n in enumerate("ab")}
    optimizer = torch.optim.Adam([fresh["b"], fresh["a"]], lr=0.5)  # configure_optimizers lists them the other way
    assert load_name_keyed_optimizer_state(optimizer, saved, names_of(fresh)) == ([], [])
    for name in "ab":
        assert torch.equal(optimizer.state[fresh[name]]["exp_avg"], saved["state"][name]["exp_avg"]), name
    assert optimizer.param_groups[0]["lr"] == 0.1  # hyperparameters come from the checkpoint, as torch loads them


def test_a_parameter_new_to_the_optimizer_starts_afresh_and_one_it_no_longer_holds_is_left_behind():
    # A table sharded when saved is data-parallel now (the dense optimizer holds it: new), and the reverse (gone).
    params = {n: torch.nn.Parameter(torch.zeros(3)) for n in ("dense", "gone")}
    saved = name_keyed_optimizer_state(trained(params, ["dense", "gone"]), names_of(params))
    fresh = {n: torch.nn.Parameter(torch.zeros(3)) for n in ("dense", "table")}
    optimizer = torch.optim.Adam([fresh["table"], fresh["dense"]], lr=0.1)
    assert load_name_keyed_optimizer_state(optimizer, saved, names_of(fresh)) == (["table"], ["gone"])
    assert torch.equal(optimizer.state[fresh["dense"]]["exp_avg"], saved["state"]["dense"]["exp_avg"])
    assert fresh["table"] not in optimizer.state
    fresh["table"].grad = torch.ones(3)
    fresh["dense"].grad = torch.ones(3)
    optimizer.step()  # the new parameter's state is made as for any first step
    assert optimizer.state[fresh["table"]]["step"] == 1 and optimizer.state[fresh["dense"]]["step"] == 4


def test_another_number_of_parameter_groups_is_a_configuration_error_naming_configure_optimizers():
    params = {n: torch.nn.Parameter(torch.zeros(3)) for n in "ab"}
    saved = name_keyed_optimizer_state(trained(params, ["a", "b"]), names_of(params))
    optimizer = torch.optim.Adam([{"params": [params["a"]]}, {"params": [params["b"]], "lr": 0.01}])
    with pytest.raises(ConfigurationError, match="1 parameter groups and configure_optimizers now makes 2"):
        load_name_keyed_optimizer_state(optimizer, saved, names_of(params))


@pytest.mark.parametrize("kind", ["adagrad", "torchrec_row_wise_adagrad"])
def test_state_an_optimizer_builds_in_its_constructor_stays_for_a_parameter_new_to_it(kind):
    # Adagrad and TorchRec's RowWiseAdagrad make their state in __init__; load_state_dict keeps only loaded state, and
    # RowWiseAdagrad's step reads state["sum"] without making it: the new (now data-parallel) table must keep it.
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    make = {"adagrad": torch.optim.Adagrad, "torchrec_row_wise_adagrad": RowWiseAdagrad}[kind]
    params = {"dense": torch.nn.Parameter(torch.zeros(2, 3))}
    old = make([params["dense"]], lr=0.1)
    params["dense"].grad = torch.ones(2, 3)
    old.step()
    saved = name_keyed_optimizer_state(old, names_of(params))
    fresh = {n: torch.nn.Parameter(torch.zeros(2, 3)) for n in ("dense", "table")}
    optimizer = make([fresh["dense"], fresh["table"]], lr=0.1)
    assert load_name_keyed_optimizer_state(optimizer, saved, names_of(fresh)) == (["table"], [])
    assert torch.equal(optimizer.state[fresh["dense"]]["sum"], saved["state"]["dense"]["sum"])
    assert not optimizer.state[fresh["table"]]["sum"].any()
    for p in fresh.values():
        p.grad = torch.ones(2, 3)
    optimizer.step()  # RowWiseAdagrad: KeyError 'sum' without it


def test_a_parameter_moved_to_another_group_is_a_configuration_error_naming_it():
    params = {n: torch.nn.Parameter(torch.zeros(3)) for n in "abc"}
    before = torch.optim.Adam([{"params": [params["a"], params["b"]]}, {"params": [params["c"]], "weight_decay": 0.1}])
    saved = name_keyed_optimizer_state(before, names_of(params))
    after = torch.optim.Adam([{"params": [params["a"]]}, {"params": [params["b"], params["c"]], "weight_decay": 0.1}])
    with pytest.raises(ConfigurationError, match=r"puts \['b'\] in another parameter group than the checkpoint's group 0"):
        load_name_keyed_optimizer_state(after, saved, names_of(params))
