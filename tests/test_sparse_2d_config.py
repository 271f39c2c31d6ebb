"""2D sparse parallelism's input checks, plan remapping and plan-cache key, on real TorchRec planners (no ranks)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from lightning_ett import ETTStrategy
from lightning_ett.strategies.plan_cache import check_plan_ranks, compute_plan, embedding_tables, plan_inputs
from lightning_ett.strategies.replica_sync import _buckets
from lightning_ett.strategies.sharders import default_sharders
from lightning_ett.strategies.sparse_2d import SHARDING_TYPES_2D, ShardingGroups, constraints_2d, remap_plan


def ebc(tables: int = 4) -> torch.nn.Module:
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f"f{i}"])
               for i in range(tables)]
    return torch.nn.Sequential(EmbeddingBagCollection(tables=configs, device=torch.device("meta")))


def plan_for(ranks: int, sharding_type: str = "table_wise"):  # type: ignore[no-untyped-def]
    module = ebc()
    constraints = {n: ParameterConstraints(sharding_types=[sharding_type]) for n in embedding_tables(module)}
    return compute_plan(module, Topology(world_size=ranks, compute_device="cpu", local_world_size=ranks),
                        default_sharders("cpu"), constraints, 512)


@pytest.mark.parametrize("size", [0, -2, True, 2.0, "2"])
def test_a_sharding_group_size_that_is_not_a_positive_int_is_rejected_by_name(size):
    with pytest.raises(ValueError, match=r"ETTStrategy\(sharding_group_size=.*expected an int >= 1"):
        ETTStrategy(sharding_group_size=size)


@pytest.mark.parametrize("interval", [0, -1, True, 1.5])
def test_a_replica_sync_interval_below_one_is_rejected_by_name(interval):
    with pytest.raises(ValueError, match=r"ETTStrategy\(replica_sync_every_n_steps=.*expected an int >= 1"):
        ETTStrategy(sharding_group_size=2, replica_sync_every_n_steps=interval)


def test_adam_tables_in_2d_are_rejected_since_the_replica_sync_would_not_average_their_moments():
    with pytest.raises(ValueError, match=r"fused_optimizer='adam', sharding_group_size=2.*row_wise_adagrad"):
        ETTStrategy(sharding_group_size=2, fused_optimizer="adam")


def test_group_sizes_that_do_not_fit_the_world_fail_when_the_trainer_is_built_before_any_rank_starts():
    with pytest.raises(ValueError, match=r"sharding_group_size=2\) does not divide the job's 3 ranks.*\[1, 3\]"):
        Trainer(accelerator="cpu", devices=3, strategy=ETTStrategy(sharding_group_size=2), logger=False)
    with pytest.raises(ValueError, match=r"sharding_group_size=4\) is larger than the job's 2 ranks"):
        Trainer(accelerator="cpu", devices=2, strategy=ETTStrategy(sharding_group_size=4), logger=False)


def test_a_group_as_large_as_the_world_is_1d_with_a_warning():
    strategy = ETTStrategy(sharding_group_size=2)
    with pytest.warns(UserWarning, match=r"sharding_group_size=2\) equals the number of ranks.*1D"):
        Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert strategy._group_size is None
    with_k = ETTStrategy(sharding_group_size=2)
    Trainer(accelerator="cpu", devices=4, strategy=with_k, logger=False)
    assert with_k._group_size == 2


def test_sharding_types_torchrec_2d_cannot_run_are_rejected_naming_the_argument():
    assert "table_column_wise" not in SHARDING_TYPES_2D
    with pytest.raises(ValueError, match=r"sharding_type=\['table_column_wise'\], sharding_group_size=2.*does not support"):
        Trainer(accelerator="cpu", devices=4, strategy=ETTStrategy(sharding_type="table_column_wise", sharding_group_size=2),
                logger=False)
    bad = {"t1": ParameterConstraints(sharding_types=["table_wise", "table_column_wise"])}
    with pytest.raises(ValueError, match=r"constraints\['t1'\]\.sharding_types=\['table_column_wise'\]"):
        Trainer(accelerator="cpu", devices=4, strategy=ETTStrategy(constraints=bad, sharding_group_size=2), logger=False)
    # 1D is unaffected
    Trainer(accelerator="cpu", devices=4, strategy=ETTStrategy(sharding_type="table_column_wise"), logger=False)


def test_the_planner_is_kept_to_2d_sharding_types_for_tables_the_user_left_to_it():
    tables = embedding_tables(ebc())
    given = {"t0": ParameterConstraints(sharding_types=["row_wise"]), "t1": ParameterConstraints(min_partition=4)}
    out = constraints_2d(given, tables)
    assert out["t0"].sharding_types == ["row_wise"]
    assert out["t1"].sharding_types == list(SHARDING_TYPES_2D) and out["t1"].min_partition == 4
    assert given["t1"].sharding_types is None  # the user's object is not changed
    assert out["t2"].sharding_types == out["t3"].sharding_types == list(SHARDING_TYPES_2D)


def test_a_group_plan_is_remapped_onto_each_group_as_dmpcollection_does():
    plan = plan_for(2)  # table-wise over one group of K = 2
    ranks_in_plan = {t: s.ranks for t, s in plan.plan["0"].items()}
    assert sorted(r for ranks in ranks_in_plan.values() for r in ranks) == [0, 0, 1, 1]
    # N = 4, K = 2: groups {0, 2} and {1, 3}; rank 3 is group-rank 1 of group 1.
    for rank, expected in ((0, {0: 0, 1: 2}), (3, {0: 1, 1: 3})):
        groups = ShardingGroups(size=2, world_size=4, rank=rank, node_group_size=2, mesh=None)  # type: ignore[arg-type]
        remapped = remap_plan(plan, groups)
        for table, sharding in remapped.plan["0"].items():
            assert sharding.ranks == [expected[r] for r in ranks_in_plan[table]]
            (shard,) = sharding.sharding_spec.shards
            assert str(shard.placement) == f"rank:{sharding.ranks[0]}/cpu"
    assert {t: s.ranks for t, s in plan.plan["0"].items()} == ranks_in_plan  # the cached group plan is not touched


def test_a_given_plan_must_be_for_the_sharding_group():
    check_plan_ranks(plan_for(2), 2)
    with pytest.raises(ValueError, match=r"places shards on ranks \[0, 1, 2, 3\].*world_size=2"):
        check_plan_ranks(plan_for(4), 2)


def test_a_topology_for_the_whole_world_is_rejected_in_2d(tmp_path):
    strategy = ETTStrategy(sharding_group_size=2, topology=Topology(world_size=4, compute_device="cpu"))
    Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    module = ebc()
    with pytest.raises(ValueError, match=r"topology=Topology\(world_size=4.*plans 2 ranks here \(the sharding group\)"):
        strategy._resolve_plan(module, embedding_tables(module))


def test_the_plan_cache_keys_on_the_sharding_group_size():
    tables = embedding_tables(ebc())
    topology = Topology(world_size=2, compute_device="cpu", local_world_size=2)
    one_d = plan_inputs(tables, topology, default_sharders("cpu"), {}, 512)
    two_d = plan_inputs(tables, topology, default_sharders("cpu"), {}, 512, sharding_group_size=2)
    assert one_d.key != two_d.key and two_d.sharding_group_size == 2


def test_replica_sync_buckets_are_bounded_and_keep_dtypes_apart():
    tensors = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.float16), torch.zeros(2)]
    buckets = list(_buckets(tensors, bucket_bytes=100))
    assert [[t.numel() for t in b] for b in buckets] == [[10, 10], [30], [2], [5]]  # 120 bytes of float32 never in one
    assert all(len({t.dtype for t in b}) == 1 for b in buckets)
