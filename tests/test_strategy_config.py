"""ETTStrategy's input checks and plan cache, on real TorchRec modules and real files."""

from __future__ import annotations

import pickle

import pytest
import torch
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from lightning_ett import ETTStrategy
from lightning_ett.strategies.plan_cache import (
    PlanCache,
    compute_plan,
    embedding_tables,
    plan_inputs,
    tables_by_module,
    validate_constraints,
)
from lightning_ett.strategies.sharders import default_sharders


def ebc(rows: int = 100) -> torch.nn.Module:
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows, feature_names=[f"f{i}"]) for i in range(3)]
    return torch.nn.Sequential(EmbeddingBagCollection(tables=configs, device=torch.device("meta")))


def test_invalid_arguments_name_the_argument_and_the_choices():
    with pytest.raises(ValueError, match=r"sharding_type='diagonal'.*table_wise"):
        ETTStrategy(sharding_type="diagonal")
    with pytest.raises(ValueError, match=r"fused_optimizer='lamb'.*row_wise_adagrad"):
        ETTStrategy(fused_optimizer="lamb")
    with pytest.raises(ValueError, match="planner_batch_size"):
        ETTStrategy(planner_batch_size=0)


def test_constraints_for_unknown_tables_or_bad_sharding_types_are_rejected():
    tables = embedding_tables(ebc())
    assert sorted(tables) == ["t0", "t1", "t2"]
    with pytest.raises(ValueError, match=r"unknown table\(s\) \['nope'\].*\['t0', 't1', 't2'\]"):
        validate_constraints({"nope": ParameterConstraints(sharding_types=["table_wise"])}, tables)
    with pytest.raises(ValueError, match="invalid sharding type 'sideways'"):
        validate_constraints({"t0": ParameterConstraints(sharding_types=["sideways"])}, tables)


def test_plan_cache_round_trips_and_rejects_a_file_written_for_other_inputs(tmp_path):
    module = ebc()
    tables = embedding_tables(module)
    topology = Topology(world_size=2, compute_device="cpu", local_world_size=2)
    sharders = default_sharders("cpu")
    constraints = {name: ParameterConstraints(sharding_types=["row_wise"]) for name in tables}
    inputs = plan_inputs(tables, topology, sharders, constraints, 512)
    plan = compute_plan(module, topology, sharders, constraints, 512)
    cache = PlanCache(tmp_path)
    assert cache.load(inputs, tables) is None
    cache.store(inputs, plan)
    assert str(cache.load(inputs, tables)) == str(plan)

    other = plan_inputs(embedding_tables(ebc(rows=999)), topology, sharders, constraints, 512)
    assert other.key != inputs.key and cache.load(other, tables) is None  # other tables: not used
    # A file under this key that was written for other inputs (copied, renamed, stale): named, set aside, planned again.
    cache.path(other.key).write_bytes(pickle.dumps({"key": inputs.key, "inputs": inputs, "plan": plan}))
    with pytest.warns(UserWarning, match=f"ignoring the plan cache entry '{cache.path(other.key)}'.*written for other inputs"):
        assert cache.load(other, tables) is None
    assert not cache.path(other.key).exists() and len(list(tmp_path.glob(f"{cache.path(other.key).name}.corrupt-*"))) == 1


def test_two_modules_that_name_their_tables_alike_both_count_in_the_plan_cache_key():
    # A two-tower model whose towers both call their tables t0..t2: a change to one tower must miss the cache (it hit
    # a stale plan, which TorchRec then refused: "Total volume of shards ... does not match tensor volume").
    def towers(user_rows: int) -> torch.nn.Module:
        return torch.nn.ModuleDict({"user": ebc(user_rows), "item": ebc(100)})

    topology = Topology(world_size=2, compute_device="cpu", local_world_size=2)
    keys = {rows: plan_inputs(tables_by_module(towers(rows)), topology, default_sharders("cpu"), {}, 512).key
            for rows in (100, 150)}
    assert keys[100] != keys[150]
    assert [path for path, _ in tables_by_module(towers(100))] == ["user.0"] * 3 + ["item.0"] * 3


@pytest.mark.parametrize("damage", [b"garbage, not a pickle", b"", "truncated"])
def test_a_damaged_plan_cache_entry_is_named_set_aside_and_planned_again(tmp_path, damage):
    module = ebc()
    tables = embedding_tables(module)
    topology = Topology(world_size=2, compute_device="cpu", local_world_size=2)
    sharders = default_sharders("cpu")
    inputs = plan_inputs(tables, topology, sharders, {}, 512)
    cache = PlanCache(tmp_path)
    path = cache.store(inputs, compute_plan(module, topology, sharders, {}, 512))
    path.write_bytes(path.read_bytes()[:40] if damage == "truncated" else damage)
    with pytest.warns(UserWarning, match=f"ignoring the plan cache entry '{path}'"):
        assert cache.load(inputs, tables) is None  # the strategy then plans again and stores a good entry
    assert not path.exists()
    cache.store(inputs, compute_plan(module, topology, sharders, {}, 512))
    assert cache.load(inputs, tables) is not None


def test_unwritable_plan_cache_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="plan_cache_dir"):
        ETTStrategy(plan_cache_dir=blocker / "plans")


def test_a_frozen_table_is_refused_naming_it():
    from lightning_ett.durable.errors import ConfigurationError
    from lightning_ett.strategies.sharders import apply_fused_optimizer

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10,
                                                            feature_names=["f0"])])
    model = torch.nn.ModuleDict({"ebc": ebc})
    ebc.requires_grad_(False)
    with pytest.raises(ConfigurationError, match=r"embedding_bags\.t0\.weight.*requires_grad=False"):
        apply_fused_optimizer(model, "row_wise_adagrad", {"lr": 0.1})
    ebc.requires_grad_(True)
    apply_fused_optimizer(model, "row_wise_adagrad", {"lr": 0.1})  # trainable: fused into backward
    assert hasattr(ebc.embedding_bags["t0"].weight, "_in_backward_optimizers")


@pytest.mark.parametrize("bag", [True, False], ids=["EmbeddingBagCollection", "EmbeddingCollection"])
def test_a_sharding_type_the_sharder_does_not_offer_is_explained_from_torchrecs_own_error(bag):
    """TorchRec's planner decides; where it finds no sharding type because none asked for is offered, the error says
    which table, what it asked and what its sharder offers here. Any other planner error is left as TorchRec's."""
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    from lightning_ett.strategies.plan_cache import SHARDING_TYPES
    from lightning_ett.strategies.sharders import explain_no_sharding_type

    if bag:
        model = ebc()
    else:
        model = torch.nn.Sequential(EmbeddingCollection(tables=[
            EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f"f{i}"]) for i in range(3)],
            device=torch.device("meta")))
    sharders = default_sharders("cpu")
    topology = Topology(world_size=2, compute_device="cpu", local_world_size=2)
    refused = {}
    for sharding_type in SHARDING_TYPES:
        constraints = {"t1": ParameterConstraints(sharding_types=[sharding_type])}
        try:
            compute_plan(model, topology, sharders, constraints, 64)
        except RuntimeError as err:
            refused[sharding_type] = explain_no_sharding_type(err, sharders, constraints, user_constrained=set())
    name = type(model[0]).__name__
    # on CPU: grid sharding is 2D-only for bags; sequence tables have no table-row-, table-column-wise or grid sharding
    assert sorted(refused) == sorted(["grid_shard"] if bag else ["table_row_wise", "table_column_wise", "grid_shard"])
    for sharding_type, said in refused.items():
        assert said.startswith(f"ETTStrategy: table 't1' ({name}) is constrained to sharding type(s) ['{sharding_type}'], "
                               f"but {type(next(s for s in sharders if s.module_type is type(model[0]))).__name__} "
                               "offers only ['data_parallel', 'table_wise'"), said
    assert ("needs 2D sparse parallelism (sharding_group_size=K)" in refused["grid_shard"]) is bag
    assert ("fails inside TorchRec 1.9.2" in refused["grid_shard"]) is not bag
    assert all("Pass sharding_type= (or constraints=" in said for said in refused.values())
    constraints = {"t1": ParameterConstraints(sharding_types=["grid_shard"])}  # the user's own constraints for t1:
    with pytest.raises(RuntimeError) as err:  # sharding_type= would not apply to it, so the fix names them
        compute_plan(model, topology, sharders, constraints, 64)
    assert "Give constraints['t1'] sharding_types with one of those" in explain_no_sharding_type(err.value, sharders,
                                                                                                 constraints, {"t1"})
    # an offered type whose compute kernel the constraints rule out: TorchRec's error stands (it names the kernel)
    constraints = {"t1": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["key_value"])}
    with pytest.raises(RuntimeError, match="No available sharding type") as err:
        compute_plan(model, topology, sharders, constraints, 64)
    assert explain_no_sharding_type(err.value, sharders, constraints, {"t1"}) is None
    assert explain_no_sharding_type(RuntimeError("something else"), sharders, constraints, {"t1"}) is None


def test_a_wrapper_modules_own_sharder_plans_what_the_inner_modules_sharder_would_not():
    """A FeatureProcessedEmbeddingBagCollection's sharder offers row-wise sharding on CPU where TorchRec's plain EBC
    sharder does not: nothing refuses it before TorchRec's planner, which plans it."""
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100, feature_names=["f0"])]
    fp = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(tables=tables, is_weighted=True, device=torch.device("meta")),
        PositionWeightedModuleCollection({"f0": 4}, device=torch.device("meta")))
    plan = compute_plan(torch.nn.Sequential(fp), Topology(world_size=2, compute_device="cpu", local_world_size=2),
                        get_default_sharders(), {"t0": ParameterConstraints(sharding_types=["row_wise"])}, 64)
    assert "row_wise" in str(plan)
