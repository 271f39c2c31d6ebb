"""2D sparse parallelism: tables sharded within groups of K ranks, the N/K groups replicas of each other.

The layout is TorchRec's ``DMPCollection`` default (``use_inter_host_allreduce=False``): with
``step = N // K``, sharding group ``g`` is the strided set ``{g, g + step, …, g + (K-1)·step}``
and each replica group is a contiguous block of ``step`` ranks, so the periodic replica sync
stays inside a host where possible while the per-step all-to-all spans only K ranks.

On CUDA the model is wrapped by TorchRec's ``DMPCollection`` itself (it remaps the plan and
builds ``ShardingEnv2D``); only its process groups come from here, created in ETTStrategy's
overlapped start-up instead of inside its constructor. ``DMPCollection`` asserts CUDA/MTIA,
so on CPU the same thing is assembled from TorchRec's parts: ``DistributedModelParallel``
with a ``ShardingEnv2D`` and the plan remapped as ``DMPCollection._remap_sharding_plan``
does (with ``cpu`` placements, which that method cannot write). The replica sync is
:mod:`.replica_sync`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.remote_device import _remote_device
from torch.distributed.tensor import DTensor
from torchrec.distributed.model_parallel import DistributedModelParallel, DMPCollection
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import EnumerableShardingSpec, ModuleSharder, ShardingEnv2D, ShardingPlan, ShardingType

from lightning_ett.durable.errors import ConfigurationError

#: Sharding types TorchRec's 2D parallelism handles (its own 2D tests cover TW, CW, RW, TWRW and
#: grid); data-parallel tables are replicated on all N ranks and kept equal by DDP, as in 1D.
#: ``table_column_wise`` has no 2D handling in TorchRec (its DTensor metadata cannot be built).
SHARDING_TYPES_2D: tuple[str, ...] = tuple(t.value for t in (
    ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE,
    ShardingType.GRID_SHARD, ShardingType.DATA_PARALLEL,
))

#: Fused optimizers whose per-row state the replica sync averages (TorchRec's 2D sync averages
#: weights and the AdaGrad ``sum``). Adam's moments would drift apart between replicas.
FUSED_OPTIMIZERS_2D = ("row_wise_adagrad", "adagrad", "sgd")


def validate_2d_arguments(size: int | None, sync_every: int, fused_optimizer: str) -> None:
    """ETTStrategy's constructor checks of its 2D arguments (the world size is not known yet)."""
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ConfigurationError(f"ETTStrategy(sharding_group_size={size!r}): expected an int >= 1 (ranks per sharding group, a "
                                 "divisor of the world size), or None for 1D sharding.")
    if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
        raise ConfigurationError(f"ETTStrategy(replica_sync_every_n_steps={sync_every!r}): expected an int >= 1 (optimizer steps "
                                 "between replica syncs).")
    if size is not None and fused_optimizer not in FUSED_OPTIMIZERS_2D:
        raise ConfigurationError(
            f"ETTStrategy(fused_optimizer={fused_optimizer!r}, sharding_group_size={size}): the 2D replica "
            "sync averages weights and AdaGrad state only (as TorchRec's DMPCollection does), so "
            f"{fused_optimizer}'s state would drift between replicas. Use one of {list(FUSED_OPTIMIZERS_2D)}.")


def validate_group_size(size: int | None, world_size: int) -> int | None:
    """The effective sharding group size for ``world_size`` ranks (``None``: 1D), or a ``ValueError`` naming the fix."""
    if size is None:
        return None
    if size > world_size:
        raise ConfigurationError(
            f"ETTStrategy(sharding_group_size={size}) is larger than the job's {world_size} ranks: a sharding "
            f"group cannot span more ranks than there are. Pass a divisor of {world_size}, or None for 1D.")
    if world_size % size:
        divisors = [k for k in range(1, world_size + 1) if world_size % k == 0]
        raise ConfigurationError(f"ETTStrategy(sharding_group_size={size}) does not divide the job's {world_size} ranks: every "
                                 f"replica must be a whole sharding group. Pass one of {divisors}.")
    if size == world_size:
        rank_zero_warn(f"ETTStrategy(sharding_group_size={size}) equals the number of ranks: one sharding group, no "
                       "replicas. This is 1D sharding; running it as such.", stacklevel=3)  # (every rank validates)
        return None
    return size


def validate_sharding_types(sharding_type: str | None, constraints: dict[str, ParameterConstraints], size: int) -> None:
    """Fail before start-up on a sharding type that TorchRec's 2D parallelism cannot run."""
    wanted = {"sharding_type": [sharding_type] if sharding_type else []}
    wanted.update({f"constraints[{name!r}].sharding_types": list(c.sharding_types or []) for name, c in constraints.items()})
    for argument, types in wanted.items():
        bad = [t for t in types if t not in SHARDING_TYPES_2D]
        if bad:
            raise ConfigurationError(
                f"ETTStrategy({argument}={bad}, sharding_group_size={size}): TorchRec's 2D sparse parallelism "
                f"does not support {', '.join(bad)}. Use one of {list(SHARDING_TYPES_2D)}, or "
                "sharding_group_size=None (1D).")


def constraints_2d(constraints: dict[str, ParameterConstraints], tables: dict[str, Any]) -> dict[str, ParameterConstraints]:
    """Keep the planner to 2D-capable sharding types for every table the user left to it."""
    allowed = [t for t in SHARDING_TYPES_2D]
    out = dict(constraints)
    for name in tables:
        if name not in out:
            out[name] = ParameterConstraints(sharding_types=allowed)
        elif not out[name].sharding_types:
            out[name] = copy.copy(out[name])
            out[name].sharding_types = allowed
    return out


def node_group_size(size: int, local_world_size: int) -> int:
    """The "host" inside a sharding group, for table-row-wise and grid sharding: it must divide K."""
    return math.gcd(size, local_world_size)


@dataclass(frozen=True)
class ShardingGroups:
    """The 2D device mesh of one job, built on every rank (``dist.new_group`` is collective)."""

    size: int  # K: ranks per sharding group
    world_size: int  # N
    rank: int
    node_group_size: int
    mesh: DeviceMesh  # dims ("replicate", "shard"), as DMPCollection builds it

    @classmethod
    def create(cls, size: int, device_type: str, local_world_size: int) -> ShardingGroups:
        """Call after the default process group exists, on every rank at the same point."""
        world_size, rank = dist.get_world_size(), dist.get_rank()
        step = world_size // size
        peers = [[step * r + group for r in range(size)] for group in range(step)]
        mesh = DeviceMesh(device_type, peers, mesh_dim_names=("replicate", "shard"))
        return cls(size, world_size, rank, node_group_size(size, local_world_size), mesh)

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.size

    @property
    def sharding_pg(self) -> dist.ProcessGroup:
        return self.mesh.get_group("shard")

    @property
    def replica_pg(self) -> dist.ProcessGroup:
        return self.mesh.get_group("replicate")

    @property
    def replica_index(self) -> int:
        """This rank's position in its replica group (= the index of its sharding group)."""
        return self.rank % self.num_replicas

    def global_rank(self, group_rank: int) -> int:
        """The global rank of this rank's sharding group that holds what the K-rank plan puts on ``group_rank``."""
        return group_rank * self.num_replicas + self.replica_index


def remap_plan(plan: ShardingPlan, groups: ShardingGroups) -> ShardingPlan:
    """A copy of the K-rank ``plan`` on this rank's sharding group (``DMPCollection._remap_sharding_plan``, on CPU)."""
    remapped = copy.deepcopy(plan)
    for module_plan in remapped.plan.values():
        for sharding in module_plan.values():  # type: ignore[union-attr]
            sharding.ranks = [groups.global_rank(r) for r in sharding.ranks] if sharding.ranks is not None else None
            spec = sharding.sharding_spec
            if isinstance(spec, EnumerableShardingSpec):
                for shard in spec.shards:
                    assert shard.placement is not None
                    shard.placement = _remote_device(f"rank:{groups.global_rank(shard.placement.rank())}/cpu")
    return remapped


def spread_over_replicas(state: Any, groups: ShardingGroups) -> Any:
    """``state`` for a checkpoint write in which each replica writes only its share of every shard.

    Each of the N/K replicas of a shard holds the same rows after a sync. Left alone, DCP's
    dedup would give each whole shard to one replica; here replica ``i`` of ``R`` keeps rows
    ``[i·n/R, (i+1)·n/R)`` of each of its local shards (views, no copy), with their offsets,
    so every rank writes 1/N of the tables, whatever the shard sizes, and AsyncCheckpoint
    stages only that share. DCP reads any of these layouts back into any other (1D, 2D, another K).
    """
    if isinstance(state, dict):
        return {key: spread_over_replicas(value, groups) for key, value in state.items()}
    local = getattr(state, "_local_tensor", None) if isinstance(state, DTensor) else None
    if local is None or not (hasattr(local, "local_shards") and hasattr(local, "local_offsets")):
        return state  # dense and data-parallel tensors: replicated everywhere, DCP writes each once
    shards, offsets = [], []
    share, replicas = groups.replica_index, groups.num_replicas
    for shard, offset in zip(local.local_shards(), local.local_offsets()):
        rows = shard.shape[0]
        lo, hi = rows * share // replicas, rows * (share + 1) // replicas
        if hi > lo:
            shards.append(shard[lo:hi])
            offsets.append(torch.Size((offset[0] + lo, *offset[1:])))
    return DTensor(type(local)(shards, offsets), state._spec, requires_grad=False)


class _StartupGroupsDMPCollection(DMPCollection):
    """TorchRec's DMPCollection with the process groups ETTStrategy created during its overlapped start-up.

    (DMPCollection builds its DeviceMesh inside its constructor, i.e. on the critical path after
    the process group; the mesh here was built while the model and plan were being made.)
    """

    def __init__(self, groups: ShardingGroups, **kwargs: Any) -> None:
        self._startup_groups = groups
        super().__init__(**kwargs)

    def _create_process_groups(self, global_rank: int, world_size: int, local_size: int,
                               use_inter_host_allreduce: bool = False) -> tuple[DeviceMesh, Any, Any]:
        groups = self._startup_groups
        assert (local_size, world_size, use_inter_host_allreduce) == (groups.size, groups.world_size, False), \
            "ETTStrategy's 2D process groups were built for another layout"
        return groups.mesh, groups.sharding_pg, groups.replica_pg


def shard_2d(module: nn.Module, plan: ShardingPlan, groups: ShardingGroups, device: torch.device,
             sharders: list[ModuleSharder[nn.Module]]) -> DistributedModelParallel:
    """Shard ``module``'s tables by the K-rank ``plan`` within this rank's sharding group; DDP over all N ranks."""
    if device.type == "cuda":
        return _StartupGroupsDMPCollection(
            groups, module=module, device=device, plan=copy.deepcopy(plan), world_size=groups.world_size,
            sharding_group_size=groups.size, global_pg=dist.group.WORLD, node_group_size=groups.node_group_size,
            sharders=sharders, init_data_parallel=True, init_parameters=True,
        )
    if device.type != "cpu":
        raise ConfigurationError(f"ETTStrategy(sharding_group_size=...) runs on CUDA (TorchRec's DMPCollection) or CPU, not on "
                                 f"{device.type!r}.")
    env = ShardingEnv2D(sharding_pg=groups.sharding_pg, replica_pg=groups.replica_pg, global_pg=dist.group.WORLD,
                        device_mesh=groups.mesh, node_group_size=groups.node_group_size)
    return DistributedModelParallel(module, env=env, device=device, plan=remap_plan(plan, groups), sharders=sharders,
                                    init_data_parallel=True, init_parameters=True)
