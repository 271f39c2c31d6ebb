"""Sharding plans computed locally on every rank, keyed, cached, and checked across ranks.

Every rank runs the same deterministic planner on the same inputs, so no rank has to wait
for rank 0 to broadcast a plan (``collective_plan``): planning can run before the process
group exists. A cache keyed by everything the plan depends on (table configs, topology,
sharders, constraints, world size, torchrec version) skips the planner on later starts.
Cache files are pickles: they are read only from the configured directory (see :class:`PlanCache`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from lightning_ett.durable.errors import ConfigurationError
from lightning_ett.durable.files import atomic_write_bytes, set_aside
from lightning_ett.instrument.quiet import loggers_at_error

SHARDING_TYPES: tuple[str, ...] = tuple(t.value for t in ShardingType)


def embedding_modules(module: nn.Module) -> list[EmbeddingBagCollection | EmbeddingCollection]:
    """The unsharded TorchRec embedding modules inside ``module`` (what DMP will shard)."""
    return [sub for sub in module.modules() if isinstance(sub, (EmbeddingBagCollection, EmbeddingCollection))]


def tables_by_module(module: nn.Module) -> list[tuple[str, BaseEmbeddingConfig]]:
    """Every table of every (unsharded) TorchRec embedding module in ``module``, with the module's path: two modules
    (a two-tower model's towers) may name their tables alike, which a plan's cache key must tell apart."""
    out: list[tuple[str, BaseEmbeddingConfig]] = []
    for path, sub in module.named_modules():
        if isinstance(sub, (EmbeddingBagCollection, EmbeddingCollection)):
            configs = sub.embedding_bag_configs() if isinstance(sub, EmbeddingBagCollection) else sub.embedding_configs()
            out.extend((path, config) for config in configs)
    return out


def embedding_tables(module: nn.Module) -> dict[str, BaseEmbeddingConfig]:
    """Every table of every (unsharded) TorchRec embedding module in ``module``, by table name (as the planner's
    constraints and plans name them)."""
    return {config.name: config for _, config in tables_by_module(module)}


def validate_constraints(constraints: dict[str, ParameterConstraints], tables: dict[str, Any]) -> None:
    unknown = sorted(set(constraints) - set(tables))
    if unknown:
        raise ConfigurationError(
            f"ETTStrategy(constraints=...): unknown table(s) {unknown}; the model's tables are {sorted(tables)}."
            )
    for name, constraint in constraints.items():
        for sharding_type in constraint.sharding_types or []:
            if sharding_type not in SHARDING_TYPES:
                raise ConfigurationError(
                    f"ETTStrategy(constraints={{{name!r}: ...}}): invalid sharding type {sharding_type!r}; "
                    f"expected one of {list(SHARDING_TYPES)}."
                    )


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan depends on; its digest is the cache key."""

    tables: tuple[tuple[Any, ...], ...]
    world_size: int
    local_world_size: int
    compute_device: str
    sharders: tuple[tuple[str, tuple[str, ...]], ...]
    constraints: tuple[tuple[str, str], ...]
    batch_size: int
    torchrec_version: str
    sharding_group_size: int | None = None  # 2D: the plan is for one group of this many ranks (None: 1D)
    memory: tuple[int, ...] = ()  # HBM and DDR per device: they decide which tables go to UVM

    @property
    def key(self) -> str:
        blob = json.dumps(self.__dict__, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:24]


def plan_inputs(
    tables: dict[str, BaseEmbeddingConfig] | list[tuple[str, BaseEmbeddingConfig]],
    topology: Topology,
    sharders: list[ModuleSharder[nn.Module]],
    constraints: dict[str, ParameterConstraints],
    batch_size: int,
    sharding_group_size: int | None = None,
) -> PlanInputs:
    import torchrec

    device = topology.compute_device
    located = [("", c) for c in tables.values()] if isinstance(tables, dict) else tables  # (module path, table)
    return PlanInputs(
        tables=tuple(sorted(
            (path, c.name, c.num_embeddings, c.embedding_dim, tuple(c.feature_names), str(c.data_type),
             str(getattr(c, "pooling", "")))
            for path, c in located
        )),
        world_size=topology.world_size,
        local_world_size=topology.local_world_size,
        compute_device=device,
        sharders=tuple(sorted((type(s).__qualname__, tuple(s.sharding_types(device))) for s in sharders)),
        constraints=tuple(sorted((name, repr(c)) for name, c in constraints.items())),
        batch_size=batch_size,
        torchrec_version=getattr(torchrec, "__version__", "unknown"),
        sharding_group_size=sharding_group_size,
        memory=tuple(int(v) for d in topology.devices for v in (d.storage.hbm, d.storage.ddr)),
    )


def compute_plan(
    module: nn.Module,
    topology: Topology,
    sharders: list[ModuleSharder[nn.Module]],
    constraints: dict[str, ParameterConstraints],
    batch_size: int,
) -> ShardingPlan:
    """Run TorchRec's planner locally (no process group, so no collective).

    Its storage reservation (TorchRec's default) warns on every plan that its dense-size estimate can be wrong in a
    dry run, where tensors are not materialized. That estimate is numel x element size of the dense parameters, which
    meta tensors have too, and ETTStrategy offers no estimate to pass: that logger is held at ERROR while planning."""
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints or None)
    with loggers_at_error("torchrec.distributed.planner.storage_reservations"):
        return planner.plan(module, sharders)


def default_topology(world_size: int, compute_device: str, local_world_size: int) -> Topology:
    """What ``Topology(world_size=..., compute_device=..., local_world_size=...)`` gives, through the factory TorchRec
    asks for (a Topology built directly logs, on every rank, that "the job will fail"; this one is the same)."""
    return TopologyFactory.create_topology(TrainerConfig(world_size=world_size, local_world_size=local_world_size),
                                           kernel_config=KernelConfig(compute_device=compute_device))


def plan_digest(plan: ShardingPlan) -> str:
    return hashlib.sha256(str(plan).encode()).hexdigest()[:16]


def planned_tables(plan: ShardingPlan) -> set[str]:
    return {table for module_plan in plan.plan.values() for table in module_plan}  # type: ignore[union-attr]


def check_plan_covers(plan: ShardingPlan, tables: dict[str, Any], source: str) -> None:
    planned = planned_tables(plan)
    missing, extra = sorted(set(tables) - planned), sorted(planned - set(tables))
    if missing or extra:
        raise ConfigurationError(
            f"The sharding plan from {source} does not match the model: tables missing from the plan {missing}, "
            f"tables in the plan but not in the model {extra}. Delete the plan (or pass one for these tables)."
            )


def check_plan_ranks(plan: ShardingPlan, num_ranks: int) -> None:
    """A given plan must place shards on the ranks the strategy plans for (2D: one sharding group)."""
    used = {rank for module_plan in plan.plan.values() for sharding in module_plan.values()  # type: ignore[union-attr]
            for rank in (sharding.ranks or [])}
    if used and max(used) >= num_ranks:
        raise ConfigurationError(f"ETTStrategy(plan=...) places shards on ranks {sorted(used)}, but plans here are for "
                                 f"{num_ranks} ranks (ranks 0..{num_ranks - 1}; with sharding_group_size=K, one sharding group). "
                                 f"Plan for world_size={num_ranks}.")


class PlanCache:
    """A directory of plans, one file per :class:`PlanInputs` key, written atomically.

    An entry that does not load (torn, garbage, another torchrec's) or does not match this
    job's inputs is named in a warning, moved aside, and the plan is computed again: a bad
    cache file must never cost a job its restarts.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigurationError(
                f"ETTStrategy(plan_cache_dir={str(directory)!r}) is not a writable directory: {err}") from err

    def path(self, key: str) -> Path:
        return self.directory / f"plan-{key}.pkl"

    def load(self, inputs: PlanInputs, tables: dict[str, Any]) -> ShardingPlan | None:
        path = self.path(inputs.key)
        read: os.stat_result | None = None
        try:
            with open(path, "rb") as f:
                read = os.fstat(f.fileno())  # which file this was: another rank may replace it meanwhile
                entry = pickle.load(f)  # only from the configured cache directory (see the class docstring)
            if not isinstance(entry, dict) or entry.get("key") != inputs.key or entry.get("inputs") != dataclasses.asdict(inputs):
                raise ValueError("it was written for other inputs (tables, topology, sharders or torchrec version)")
            plan = entry["plan"]
            if not isinstance(plan, ShardingPlan):
                raise TypeError(f"it holds a {type(plan).__name__}, not a ShardingPlan")
            check_plan_covers(plan, tables, f"plan cache {str(path)!r}")
        except FileNotFoundError:
            return None  # no entry for these inputs yet
        except Exception as e:  # noqa: BLE001 - any bad entry: say which, set it aside, plan again
            self._set_aside(path, read, e)
            return None
        return plan

    def _set_aside(self, path: Path, read: os.stat_result | None, error: Exception) -> None:
        try:
            now = os.stat(path)
            if read is not None and (now.st_ino, now.st_mtime_ns) != (read.st_ino, read.st_mtime_ns):
                raise FileNotFoundError  # another rank already replaced it with a good entry: leave that one
            moved = f"moved aside to {str(set_aside(path))!r}"
        except OSError:
            moved = "another rank set it aside"
        warnings.warn(f"ETTStrategy: ignoring the plan cache entry {str(path)!r} ({type(error).__name__}: {error}); "
                      f"{moved}, planning again.", stacklevel=3)

    def store(self, inputs: PlanInputs, plan: ShardingPlan) -> Path:
        """Write the entry (plain dicts and TorchRec's plan: nothing of this package's, so it survives our refactors)."""
        entry = {"key": inputs.key, "inputs": dataclasses.asdict(inputs), "plan": plan, "torch": torch.__version__}
        return atomic_write_bytes(self.path(inputs.key), pickle.dumps(entry))
