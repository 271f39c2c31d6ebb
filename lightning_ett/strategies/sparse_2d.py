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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.remote_device import _remote_device
from torch.distributed.tensor import DTensor
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.model_parallel import DistributedModelParallel, DMPCollection
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import EnumerableShardingSpec, ModuleSharder, ShardingEnv2D, ShardingPlan, ShardingType

from lightning_ett.durable.errors import ConfigurationError

#: Sharding types TorchRec's 2D parallelism handles: ``DMPCollection`` rejects none by name and
#: builds 2D sharding for TW, CW, TWCW (the CW path), RW, TWRW and grid (tests/distributed/
#: test_sparse_2d.py runs each on 4 gloo ranks); data-parallel tables ignore the sharding groups:
#: they are replicated on all N ranks and kept equal by DDP, as in 1D. Key-value tables are not
#: sharded by ``EmbeddingBagCollection`` sharders at all.
SHARDING_TYPES_2D: tuple[str, ...] = tuple(t.value for t in (
    ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE, ShardingType.ROW_WISE,
    ShardingType.TABLE_ROW_WISE, ShardingType.GRID_SHARD, ShardingType.DATA_PARALLEL,
))

#: Compute kernels whose whole state the replica sync reaches, for sharded (not data-parallel)
#: tables: fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` with its rows in HBM (``fused``) or
#: in UVM without a cache (``fused_uvm``). Refused: ``fused_uvm_caching`` (the sync averages the
#: UVM backing rows, but ``split_embedding_weights`` does not see the HBM cache, whose dirty
#: lines are later written back un-averaged; flushing and invalidating the cache at every sync
#: would cost more than the cache saves, so it is refused rather than flushed), ``dense`` (a
#: ``DenseTableBatchedEmbeddingBagsCodegen`` that neither TorchRec's sync nor ours averages), and
#: the key-value, SSD and virtual-table kernels (not table-batched: never averaged).
SYNCED_KERNELS_2D: tuple[str, ...] = (EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.FUSED_UVM.value)
#: Sharding types that split a table over the ranks of a host inside the group: not in a group of one rank.
NEEDS_A_HOST = (ShardingType.TABLE_ROW_WISE.value, ShardingType.GRID_SHARD.value)
_UNSYNCED_WHY = ("fused_uvm_caching keeps rows in an HBM cache the sync does not see, whose dirty lines later "
                 "overwrite the averaged rows; dense and key-value kernels are never averaged, so replicas drift apart")
_KERNEL_FIX = ("'fused' (on CUDA also 'fused_uvm': rows in host memory without a cache, for tables larger than "
               "HBM) for sharded tables, 'dense' for data-parallel ones")
#: Data-parallel tables: DDP all-reduces their gradients over all N ranks, so they never diverge.
DATA_PARALLEL_KERNELS_2D: tuple[str, ...] = (EmbeddingComputeKernel.DENSE.value,)


#: Fused optimizers whose per-row state the replica sync averages (TorchRec's 2D sync averages
#: weights and the AdaGrad ``sum``). Adam's moments would drift apart between replicas.
FUSED_OPTIMIZERS_2D = ("row_wise_adagrad", "adagrad", "sgd")


#: ``replica_lr_scale="auto"``: the factor on the fused optimizer's learning rate in 2D, by optimizer, from
#: benchmarks/sparse_2d_lr.py. Row-wise AdaGrad: each replica's accumulator grows on its own group's noisier
#: gradients, so 2D learns slower early; lr x R brought the first quarter of the curve within 3.4 % of 1D's
#: at R = 2 and 4 (same lr: up to 15 % behind). SGD: TorchRec divides the embedding gradient by the all-to-all's
#: world size, so a sync every step averages R updates of the mean gradient over K ranks into 1D's update
#: (measured equal to 1D): no scale. AdaGrad (element-wise) is not measured: no scale.
AUTO_LR_SCALE = {"row_wise_adagrad": "replicas", "sgd": 1.0, "adagrad": 1.0}


def replica_lr_factor(scale: float | str, fused_optimizer: str, replicas: int) -> float:
    """What ``replica_lr_scale`` multiplies the fused optimizer's learning rate by, with ``replicas`` replicas."""
    if scale == "auto":
        scale = AUTO_LR_SCALE.get(fused_optimizer, 1.0)
    return float(replicas) if scale == "replicas" else float(scale)


def validate_2d_arguments(size: int | None, sync_every: int, fused_optimizer: str, lr_scale: float | str = 1.0) -> None:
    """ETTStrategy's constructor checks of its 2D arguments (the world size is not known yet)."""
    if not (lr_scale in ("auto", "replicas") or (isinstance(lr_scale, (int, float)) and not isinstance(lr_scale, bool)
                                                  and lr_scale > 0)):
        raise ConfigurationError(f"ETTStrategy(replica_lr_scale={lr_scale!r}): expected a number > 0, 'replicas' (x R) or "
                                 "'auto' (x R for row_wise_adagrad, x 1 for sgd and adagrad).")
    if size is None and lr_scale != 1.0:
        raise ConfigurationError(f"ETTStrategy(replica_lr_scale={lr_scale!r}) scales the tables' learning rate in 2D only; "
                                 "pass sharding_group_size=K too, or leave replica_lr_scale at 1.")
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


def validate_2d_constraints(sharding_type: str | None, constraints: dict[str, ParameterConstraints], size: int) -> None:
    """Fail when the Trainer is built, before any rank starts, on a sharding type or compute kernel 2D cannot keep in sync.

    (Every sharding type of this TorchRec is 2D-capable; the type check guards against a future one.)
    """
    wanted = {"sharding_type": [sharding_type] if sharding_type else []}
    wanted.update({f"constraints[{name!r}].sharding_types": list(c.sharding_types or []) for name, c in constraints.items()})
    for argument, types in wanted.items():
        bad = [t for t in types if t not in SHARDING_TYPES_2D]
        if bad:
            raise ConfigurationError(
                f"ETTStrategy({argument}={bad}, sharding_group_size={size}): TorchRec's 2D sparse parallelism "
                f"does not support {', '.join(bad)}. Use one of {list(SHARDING_TYPES_2D)}, or "
                "sharding_group_size=None (1D).")
        needs_a_host = [t for t in types if t in NEEDS_A_HOST]
        if size == 1 and needs_a_host:
            raise _one_rank_group_error(f"ETTStrategy({argument}={needs_a_host}, sharding_group_size=1): "
                                        f"{', '.join(needs_a_host)}", "table_wise / row_wise")
    for name, constraint in constraints.items():
        bad = [k for k in constraint.compute_kernels or [] if k not in _safe_kernels(constraint.sharding_types)]
        if bad:
            raise ConfigurationError(
                f"ETTStrategy(constraints[{name!r}].compute_kernels={bad}, sharding_group_size={size}): the 2D replica "
                f"sync cannot average table {name!r} with {', '.join(bad)} ({_UNSYNCED_WHY}). Use {_KERNEL_FIX}, or "
                "sharding_group_size=None (1D).")


def constraints_2d(constraints: dict[str, ParameterConstraints], tables: dict[str, Any],
                   size: int) -> dict[str, ParameterConstraints]:
    """Keep the planner to kernels the replica sync reaches, for every table whose kernels the user left to it.

    Sharding types stay the user's or TorchRec's choice (naming them all would switch off the planner's own guards,
    e.g. no row-wise types for feature-processed collections unless asked), except in groups of one rank, where
    only table-wise and data-parallel make sense. Kernels the user named are kept as given:
    :func:`validate_2d_constraints` and :func:`check_plan_2d` refuse unsafe ones.
    """
    out = dict(constraints)
    for name in tables:
        constraint = copy.copy(out.get(name) or ParameterConstraints())
        if size == 1 and not constraint.sharding_types:
            constraint.sharding_types = [ShardingType.TABLE_WISE.value, ShardingType.DATA_PARALLEL.value]
        if not constraint.compute_kernels:
            constraint.compute_kernels = list(_safe_kernels(constraint.sharding_types))
        out[name] = constraint
    return out


def _safe_kernels(types: list[str] | None) -> tuple[str, ...]:
    """The kernels the replica sync reaches for a table that may be sharded as ``types`` (``None``: any)."""
    types = types or list(SHARDING_TYPES_2D)
    return (*(SYNCED_KERNELS_2D if any(t != ShardingType.DATA_PARALLEL.value for t in types) else ()),
            *(DATA_PARALLEL_KERNELS_2D if ShardingType.DATA_PARALLEL.value in types else ()))


def _one_rank_group_error(what: str, fix: str) -> ConfigurationError:
    """Table-row-wise or grid (``what`` names it) asked of a group of one rank; ``fix``: the user's way out."""
    return ConfigurationError(f"{what} splits a table over the ranks of a host inside the sharding group, and a group "
                              f"of one rank has none (TorchRec fails deep in sharding). Use sharding_group_size >= 2, "
                              f"or {fix}.")


def check_modules_2d(module: nn.Module) -> None:
    """Refuse what the replica sync cannot keep equal: managed-collision modules (their id-to-slot maps differ
    between replicas; TorchRec's 2D sync handles only its hash-ZCH variant, on CUDA)."""
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    found = [name for name, sub in module.named_modules() if isinstance(sub, BaseManagedCollisionEmbeddingCollection)]
    if found:
        raise ConfigurationError(
            f"ETTStrategy(sharding_group_size=...): {found[0]!r} is a managed-collision embedding collection, whose "
            "id-to-slot mapping the 2D replica sync does not average (replicas would average rows of different ids). "
            "Use sharding_group_size=None (1D) for this model.")


def check_plan_2d(plan: ShardingPlan, size: int, given: bool = False) -> None:
    """Refuse, before the first step, a plan with a table the 2D replica sync would leave diverged or cannot shard.

    ``given``: the user passed the plan (the fix is then in the plan, not in ``constraints``).
    """
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():  # type: ignore[union-attr]
            kind, kernel = sharding.sharding_type, sharding.compute_kernel
            if kind not in SHARDING_TYPES_2D:
                raise ConfigurationError(
                    f"ETTStrategy(sharding_group_size={size}): the plan shards table {table!r} {kind}, which TorchRec's "
                    f"2D sparse parallelism does not support. Constrain it to one of {list(SHARDING_TYPES_2D)} "
                    f"(constraints={{{table!r}: ParameterConstraints(sharding_types=[...])}}), or use sharding_group_size=None.")
            if size == 1 and kind in NEEDS_A_HOST:
                raise _one_rank_group_error(
                    f"ETTStrategy(sharding_group_size=1): table {table!r} is planned {kind}, which",
                    "plan it table_wise" if given else
                    f"constraints={{{table!r}: ParameterConstraints(sharding_types=['table_wise'])}}")
            holders = set(sharding.ranks or [])
            if kind == ShardingType.TABLE_COLUMN_WISE.value and holders != set(range(size)):
                raise ConfigurationError(
                    f"ETTStrategy(sharding_group_size={size}): table {table!r} is planned table_column_wise on "
                    f"{len(holders)} of the group's {size} ranks; TorchRec's 2D sharding cannot build it on a rank that "
                    "holds none of it (its global-shape helper has no table-column-wise case). Split it into a multiple "
                    f"of {size} column shards (constraints={{{table!r}: ParameterConstraints(min_partition=<dim / "
                    f"{size}>)}}), or shard it column_wise.")
            allowed = DATA_PARALLEL_KERNELS_2D if kind == ShardingType.DATA_PARALLEL.value else SYNCED_KERNELS_2D
            if kernel not in allowed:
                raise ConfigurationError(
                    f"ETTStrategy(sharding_group_size={size}): table {table!r} is planned {kind} with compute kernel "
                    f"{kernel!r}, which the 2D replica sync cannot average ({_UNSYNCED_WHY}). "
                    + (f"Set that table's compute_kernel in your plan to {_KERNEL_FIX}" if given else
                       f"Pass constraints={{{table!r}: ParameterConstraints(compute_kernels=[...])}} with {_KERNEL_FIX}")
                    + ", or sharding_group_size=None (1D).")


def node_group_size(size: int, local_world_size: int, world_size: int) -> int:
    """How many ranks of one sharding group share a host: table-row-wise and grid's "host" inside the group.

    Groups are strided ({g, g + N/K, ...}), so a host of L ranks holds K·L/N of each group's K ranks (all K on
    one host; fewer as N grows). It must divide K; where it is not a whole divisor, 1.
    """
    per_host, rest = divmod(size * local_world_size, world_size)
    return per_host if per_host >= 1 and not rest and size % per_host == 0 else 1


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
        return cls(size, world_size, rank, node_group_size(size, local_world_size, world_size), mesh)

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
