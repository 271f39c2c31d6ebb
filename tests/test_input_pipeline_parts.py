"""The parts of ETTStrategy's input pipeline that need no process group: finding a module's input in a batch,
reading one batch ahead, and the checks that turn the pipeline off (with the reason) or refuse an argument."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_ett import ETTStrategy
from lightning_ett.durable.errors import ConfigurationError
from lightning_ett.strategies.input_pipeline import NOTHING, LookAhead, call_args_in, find_in_batch


def kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(keys=["a"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))


@dataclass
class Batch:
    dense: torch.Tensor
    sparse: KeyedJaggedTensor


class Plain:
    def __init__(self, features: dict[str, KeyedJaggedTensor]) -> None:
        self.features = features


def test_a_module_input_is_found_by_identity_along_attributes_keys_and_indices():
    user, item = kjt(), kjt()
    batch = (torch.zeros(1), Plain({"user": user, "item": item}))
    found = find_in_batch(batch, item)
    assert found is not None and found.process_steps(batch) is item
    dataclass_batch = Batch(torch.zeros(1), user)
    assert find_in_batch(dataclass_batch, user).process_steps(dataclass_batch) is user
    args = call_args_in(dataclass_batch, (user,), {})
    assert args is not None and args.build_args_kwargs(dataclass_batch)[0][0] is user


def test_an_input_made_in_forward_is_not_found_even_if_equal():
    batch = Batch(torch.zeros(1), kjt())
    equal_copy = KeyedJaggedTensor(keys=batch.sparse.keys(), values=batch.sparse.values(), lengths=batch.sparse.lengths())
    assert find_in_batch(batch, equal_copy) is None
    assert call_args_in(batch, (batch.sparse, equal_copy), {}) is None


def test_look_ahead_shows_the_next_item_and_still_yields_every_item_once():
    ahead = LookAhead(iter([1, 2, 3]))
    assert next(ahead) == 1
    assert ahead.peek() == 2 and ahead.peek() == 2
    assert list(ahead) == [2, 3]
    assert ahead.peek() is NOTHING


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_pipeline_must_be_a_bool(value):
    with pytest.raises(ConfigurationError, match=r"ETTStrategy\(pipeline="):
        ETTStrategy(pipeline=value)
