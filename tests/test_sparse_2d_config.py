"""2D sparse parallelism's input checks, plan remapping and plan-cache key, on real TorchRec planners (no ranks)."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from torchrec.distributed.model_parallel import DMPCollection
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from lightning_ett import ETTStrategy
from lightning_ett.strategies.plan_cache import check_plan_ranks, compute_plan, embedding_tables, plan_inputs
from lightning_ett.strategies.replica_sync import _buckets
from lightning_ett.strategies.sharders import default_sharders
from lightning_ett.strategies.sparse_2d import (
    SHARDING_TYPES_2D,
    SYNCED_KERNELS_2D,
    ShardingGroups,
    check_modules_2d,
    check_plan_2d,
    constraints_2d,
    remap_plan,
    replica_lr_factor,
)


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


def test_every_sharding_type_of_this_torchrec_is_accepted_in_2d_and_unsynced_kernels_are_refused_by_table():
    assert set(SHARDING_TYPES_2D) == {t.value for t in ShardingType}  # DMPCollection rejects none (see sparse_2d.py)
    for sharding_type in SHARDING_TYPES_2D:
        Trainer(accelerator="cpu", devices=4, strategy=ETTStrategy(sharding_type=sharding_type, sharding_group_size=2),
                logger=False)
    for kernel in ("fused_uvm_caching", "key_value", "ssd_virtual_table"):
        bad = {"t1": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["fused", kernel])}
        with pytest.raises(ValueError, match=rf"constraints\['t1'\]\.compute_kernels=\['{kernel}'\], sharding_group_size=2\)"
                                             rf".*table 't1' with {kernel}"):
            Trainer(accelerator="cpu", devices=4, strategy=ETTStrategy(constraints=bad, sharding_group_size=2), logger=False)
        Trainer(accelerator="cpu", devices=4, strategy=ETTStrategy(constraints=bad), logger=False)  # 1D is unaffected


def cuda_plan(constraints: dict[str, ParameterConstraints]):  # type: ignore[no-untyped-def]
    """A plan for two GPUs with 256 MiB of HBM each and four 0.5 GiB tables (planned here, without GPUs)."""
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=2_000_000, feature_names=[f"f{i}"])
               for i in range(4)]
    module = torch.nn.Sequential(EmbeddingBagCollection(tables=configs, device=torch.device("meta")))
    topology = Topology(world_size=2, compute_device="cuda", local_world_size=2, hbm_cap=256 * 2**20)
    return compute_plan(module, topology, default_sharders("cuda"), constraints, 512), embedding_tables(module)


def test_on_gpus_the_2d_planner_uses_uncached_uvm_where_1d_would_cache_and_a_cached_plan_is_refused_by_table():
    free, tables = cuda_plan({})
    kernels = {t: s.compute_kernel for t, s in free.plan["0"].items()}
    assert "fused_uvm_caching" in kernels.values()  # what the planner picks when HBM is short
    with pytest.raises(ValueError, match=r"table '(t\d)' is planned \w+ with compute kernel 'fused_uvm_caching'.*HBM "
                                         r"cache.*constraints=\{'t\d': ParameterConstraints\(compute_kernels=\[...\]\)\} "
                                         r"with 'fused' \(on CUDA also 'fused_uvm'"):
        check_plan_2d(free, 2)
    kept, _ = cuda_plan(constraints_2d({}, tables, 2))
    assert "fused_uvm" in {s.compute_kernel for s in kept.plan["0"].values()} <= set(SYNCED_KERNELS_2D)
    check_plan_2d(kept, 2)


def test_a_given_plan_with_a_dense_sharded_table_is_refused_before_any_step():
    dense = plan_for(2)
    dense.plan["0"]["t2"].compute_kernel = "dense"
    strategy = ETTStrategy(sharding_group_size=2, plan=dense)
    Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    module = ebc()
    with pytest.raises(ValueError, match=r"table 't2' is planned table_wise with compute kernel 'dense'.*never averaged"):
        strategy._resolve_plan(module, embedding_tables(module))
    dense.plan["0"]["t2"].compute_kernel = "fused"
    assert strategy._resolve_plan(module, embedding_tables(module)) is dense


def test_the_2d_planner_is_kept_to_synced_kernels_and_left_its_own_sharding_type_guards():
    tables = embedding_tables(ebc())
    given = {"t0": ParameterConstraints(sharding_types=["row_wise"]), "t1": ParameterConstraints(min_partition=4)}
    out = constraints_2d(given, tables, 2)
    assert out["t0"].sharding_types == ["row_wise"] and out["t0"].compute_kernels == ["fused", "fused_uvm"]
    assert out["t1"].min_partition == 4 and out["t1"].compute_kernels == ["fused", "fused_uvm", "dense"]
    assert given["t1"].compute_kernels is None  # the user's object is not changed
    assert out["t1"].sharding_types is out["t2"].sharding_types is None  # TorchRec's planner keeps choosing the type
    only_dp = constraints_2d({"t0": ParameterConstraints(sharding_types=["data_parallel"])}, tables, 2)
    assert only_dp["t0"].compute_kernels == ["dense"]
    one_rank_groups = constraints_2d(given, tables, 1)
    assert one_rank_groups["t2"].sharding_types == ["table_wise", "data_parallel"]
    assert one_rank_groups["t0"].sharding_types == ["row_wise"]


def test_types_that_need_a_host_are_refused_for_groups_of_one_rank_and_a_given_plan_is_told_to_change_itself():
    with pytest.raises(ValueError, match=r"sharding_type=\['table_row_wise'\], sharding_group_size=1\).*group of one rank"):
        Trainer(accelerator="cpu", devices=4, strategy=ETTStrategy(sharding_type="table_row_wise", sharding_group_size=1),
                logger=False)
    plan = plan_for(1, "table_row_wise")
    with pytest.raises(ValueError, match=r"table 't\d' is planned table_row_wise.*plan it table_wise"):
        check_plan_2d(plan, 1, given=True)
    dense = plan_for(2)
    dense.plan["0"]["t1"].compute_kernel = "dense"
    with pytest.raises(ValueError, match=r"Set that table's compute_kernel in your plan to 'fused'"):
        check_plan_2d(dense, 2, given=True)


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "column_wise", "table_column_wise", "table_row_wise",
                                           "grid_shard", "data_parallel"])
@pytest.mark.parametrize(("world", "k"), [(4, 2), (4, 1), (8, 2), (8, 4)])
def test_remap_plan_places_every_shard_where_torchrecs_own_remap_does(sharding_type, world, k, monkeypatch):
    """``remap_plan`` against ``DMPCollection._remap_sharding_plan`` itself, on plans from the real planner."""
    from torchrec.distributed import model_parallel

    # TorchRec's remap writes the local device index from it (it asks the default process group for the world size).
    monkeypatch.setattr(model_parallel, "get_local_size", lambda world_size=None: world)
    module = ebc()
    local = math.gcd(k, world)
    constraints = {n: ParameterConstraints(sharding_types=[sharding_type], min_partition=4) for n in embedding_tables(module)}
    plan = compute_plan(module, Topology(world_size=k, compute_device="cpu", local_world_size=local),
                        default_sharders("cpu", two_d=True), constraints, 512)
    before = str(plan)
    placed = set()
    for rank in range(world):
        groups = ShardingGroups(size=k, world_size=world, rank=rank, node_group_size=local, mesh=None)  # type: ignore[arg-type]
        ours = remap_plan(plan, groups)
        theirs = copy.deepcopy(plan)
        DMPCollection._remap_sharding_plan(SimpleNamespace(_device=torch.device("cpu")), theirs, rank, world // k, k)
        for table, sharding in ours.plan["0"].items():
            expected = theirs.plan["0"][table]
            assert sharding.ranks == expected.ranks, (rank, table)
            def shards(spec):  # type: ignore[no-untyped-def]  # (data-parallel tables have none)
                return [(s.shard_offsets, s.shard_sizes, s.placement.rank(), s.placement.device().type)
                        for s in (spec.shards if spec is not None else [])]

            assert shards(sharding.sharding_spec) == shards(expected.sharding_spec), (rank, table)
            placed.update(sharding.ranks)
    assert placed == set(range(world))  # every rank holds shards of some replica
    assert str(plan) == before  # the group plan (cached, shared) is not touched


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


@pytest.mark.parametrize("scale", [0, -1.0, True, "x2", None])
def test_a_replica_lr_scale_that_is_not_positive_or_a_known_word_is_rejected_by_name(scale):
    with pytest.raises(ValueError, match=r"ETTStrategy\(replica_lr_scale=.*expected a number > 0, 'replicas'"):
        ETTStrategy(sharding_group_size=2, replica_lr_scale=scale)


def test_replica_lr_scale_without_2d_is_refused_and_auto_follows_the_measured_optimizers():
    with pytest.raises(ValueError, match=r"replica_lr_scale=2\) scales the tables' learning rate in 2D only"):
        ETTStrategy(replica_lr_scale=2)
    ETTStrategy(replica_lr_scale=1.0)  # the default, 1D
    assert replica_lr_factor("auto", "row_wise_adagrad", 4) == 4.0
    assert replica_lr_factor("auto", "sgd", 4) == replica_lr_factor("auto", "adagrad", 4) == 1.0
    assert replica_lr_factor("replicas", "sgd", 3) == 3.0 and replica_lr_factor(0.5, "sgd", 3) == 0.5


def test_a_managed_collision_collection_is_refused_in_2d_naming_it():
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule

    configs = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100, feature_names=["f0"])]
    remapper = MCHManagedCollisionModule(zch_size=100, device=torch.device("cpu"), eviction_interval=1,
                                         eviction_policy=DistanceLFU_EvictionPolicy())
    module = torch.nn.Sequential(EmbeddingBagCollection(tables=configs), ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables=configs), ManagedCollisionCollection({"t0": remapper}, configs)))
    with pytest.raises(ValueError, match=r"'1' is a managed-collision embedding collection.*sharding_group_size=None"):
        check_modules_2d(module)
    check_modules_2d(ebc())  # a plain collection is fine


def test_a_2d_plan_the_planner_cannot_find_is_explained_with_the_topology_to_pass():
    strategy = ETTStrategy(sharding_group_size=2, topology=Topology(world_size=2, compute_device="cpu", local_world_size=2,
                                                                    hbm_cap=2**10, ddr_cap=2**10))
    Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    module = ebc()
    with pytest.raises(ValueError, match=r"(?s)sharding_group_size=2\): TorchRec's planner found no plan for one group of 2 "
                                         r"ranks.*topology=TopologyFactory\.create_topology\(TrainerConfig\(world_size=2, "
                                         r"hbm_cap_bytes=\.\.\., ddr_cap_bytes=\.\.\.\), kernel_config=KernelConfig\("
                                         r"compute_device=\.\.\.\)\)"):
        strategy._resolve_plan(module, embedding_tables(module))
