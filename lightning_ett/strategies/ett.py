"""ETTStrategy: TorchRec sharding as a Lightning Strategy, with a shorter start-up.

Lightning hooks only; the work is delegated: :mod:`lightning_ett.instrument.background` (process group in the
background), :mod:`.plan_cache` (local planning and its cache), :mod:`lightning_ett.checkpoint.sharded` (DCP).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
from typing_extensions import override

from lightning_ett.checkpoint import sharded as ckpt
from lightning_ett.durable.commit import retire
from lightning_ett.durable.errors import ConfigurationError
from lightning_ett.instrument.background import BackgroundTask
from lightning_ett.instrument.quiet import hide_upstream_deprecations
from lightning_ett.instrument.timeline import SPARSE_2D_FACT, Phase, get_timeline, record_phase
from lightning_ett.patching import Patches
from lightning_ett.strategies import sigterm
from lightning_ett.strategies.gc_freeze import StartupObjectsFrozen
from lightning_ett.strategies.plan_cache import (
    SHARDING_TYPES,
    PlanCache,
    check_plan_covers,
    check_plan_ranks,
    compute_plan,
    default_topology,
    embedding_tables,
    plan_digest,
    plan_inputs,
    planned_tables,
    tables_by_module,
    validate_constraints,
)
from lightning_ett.strategies.process_group import default_backend, init_process_group
from lightning_ett.strategies.replica_sync import ReplicaSync
from lightning_ett.strategies.sharders import (
    EC_DATA_PARALLEL_FAILS,
    FUSED_OPTIMIZERS,
    apply_fused_optimizer,
    check_fused_optimizer,
    data_parallel_sequence_tables,
    default_lr,
    default_sharders,
    embedding_output_dtypes,
    explain_no_sharding_type,
)
from lightning_ett.strategies.sparse_2d import (
    SYNCED_KERNELS_2D,
    ShardingGroups,
    check_modules_2d,
    check_plan_2d,
    constraints_2d,
    node_group_size,
    replica_lr_factor,
    shard_2d,
    spread_over_replicas,
    validate_2d_arguments,
    validate_2d_constraints,
    validate_group_size,
)

#: Name of the communication-free start-up hook ETTStrategy calls on the LightningModule and
#: the LightningDataModule while the process group forms (open datasets, warm loaders).
OVERLAP_HOOK = "setup_overlapped"


class ETTStrategy(ParallelStrategy):
    r"""Shard a LightningModule's TorchRec embedding tables with ``DistributedModelParallel``.

    Start-up is shortened by creating the process group in a background thread while this
    rank builds the model (``configure_model``), plans the sharding locally (or loads a
    cached plan) and runs the ``setup_overlapped()`` hook of the module and datamodule.

    With ``sharding_group_size=K`` (2D sparse parallelism) the tables are sharded within each
    group of K ranks and the N/K groups are data-parallel replicas of each other, so each
    step's embedding all-to-all spans K ranks instead of N; dense parameters stay
    data-parallel over all N ranks. Every ``replica_sync_every_n_steps`` optimizer steps the
    replicas of each table are averaged (weights and row-wise AdaGrad state, as TorchRec's
    ``DMPCollection`` does; see :mod:`lightning_ett.strategies.replica_sync`), and again before
    anything reads the tables as one model — a checkpoint (so a publish), validation, test,
    predict, the end of fit — if a training batch ran since (micro-batches count: the
    fused optimizer steps in every backward, however it is called). Sharded tables are kept to kernels the sync
    reaches (``fused``, ``fused_uvm``); a plan with any other is refused, naming the table.
    The groups' process groups form in the overlapped start-up (``process_group_init``).

    Args:
        sharding_type: one sharding type for every table (``"table_wise"``, ``"row_wise"``,
            ``"data_parallel"``, ``"column_wise"`` …); ``None`` lets the planner choose.
        constraints: per-table ``ParameterConstraints`` (override ``sharding_type``).
        sharders: TorchRec sharders; default: TorchRec's, with row-wise enabled on CPU.
        plan: a precomputed ``ShardingPlan`` (skips the planner).
        topology: the planner's ``Topology``; default: world size, ranks per node and device type
            of this job with TorchRec's default memory sizes (pass one to give the real HBM, built
            with TorchRec's ``TopologyFactory.create_topology``: a ``Topology(...)`` built directly
            works the same but logs, on every rank, that "the job will fail").
        fused_optimizer: optimizer the tables use, fused into backward: ``row_wise_adagrad``,
            ``adagrad``, ``sgd`` or ``adam`` (CUDA only: fbgemm's CPU kernels lack it). Dense
            parameters use ``configure_optimizers``.
        fused_optimizer_kwargs: its hyper-parameters (default ``{"lr": 0.01}``).
        plan_cache_dir: directory of cached plans (shared by the job's attempts).
        planner_batch_size: per-rank batch size the planner's cost model assumes.
        overlap_startup: ``False`` runs the start-up parts one after the other (for comparison).
        process_group_backend: default ``nccl`` on GPUs, ``gloo`` on CPU.
        sharding_group_size: ranks per sharding group K (a divisor of the world size N), or
            ``None`` for 1D sharding over all ranks. K = N is 1D (with a warning). The
            planner plans for K ranks (a given ``plan`` or ``topology`` must describe K ranks).
        replica_sync_every_n_steps: optimizer steps between replica syncs (2D only).
        replica_lr_scale: 2D only: the fused optimizer's learning rate is multiplied by it: a number,
            ``"replicas"`` (R = N/K) or ``"auto"`` (R for ``row_wise_adagrad``, whose 2D curve then
            follows 1D's; 1 for ``sgd``, which 2D already trains as 1D; 1 for ``adagrad``, not
            measured). Default 1: TorchRec's semantics. See README, "Learning rate".
        pipeline: start the next training batch's sparse input distribution (its KJT all-to-all) while
            this batch trains, as TorchRec's ``TrainPipelineSparseDist`` does (see
            :mod:`lightning_ett.strategies.input_pipeline`); ``False`` keeps the plain schedule.
        gc_freeze: before a fit's first step, collect Python's garbage once on every rank and freeze the
            survivors, so that no collection during training traverses start-up's objects (see
            :mod:`lightning_ett.strategies.gc_freeze`); unfrozen at the fit's teardown. A freeze made
            elsewhere, or automatic collection turned off, is left alone; ``False`` leaves the collector alone.
    """

    def __init__(
        self,
        sharding_type: str | None = None,
        constraints: dict[str, ParameterConstraints] | None = None,
        sharders: list[ModuleSharder[nn.Module]] | None = None,
        plan: ShardingPlan | None = None,
        topology: Topology | None = None,
        fused_optimizer: str = "row_wise_adagrad",
        fused_optimizer_kwargs: dict[str, Any] | None = None,
        plan_cache_dir: str | Path | None = None,
        planner_batch_size: int = 512,
        overlap_startup: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        sharding_group_size: int | None = None,
        replica_sync_every_n_steps: int = 1,
        replica_lr_scale: float | str = 1.0,
        pipeline: bool = True,
        gc_freeze: bool = True,
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        hide_upstream_deprecations()
        validate_2d_arguments(sharding_group_size, replica_sync_every_n_steps, fused_optimizer, replica_lr_scale)
        if sharding_type is not None and sharding_type not in SHARDING_TYPES:
            raise ConfigurationError(
                f"ETTStrategy(sharding_type={sharding_type!r}): expected one of {list(SHARDING_TYPES)} or None.")
        if fused_optimizer not in FUSED_OPTIMIZERS:
            raise ConfigurationError(
                f"ETTStrategy(fused_optimizer={fused_optimizer!r}): expected one of {sorted(FUSED_OPTIMIZERS)}.")
        if not isinstance(pipeline, bool):
            raise ConfigurationError(f"ETTStrategy(pipeline={pipeline!r}): expected True or False.")
        if not isinstance(gc_freeze, bool):
            raise ConfigurationError(f"ETTStrategy(gc_freeze={gc_freeze!r}): expected True or False.")
        if not isinstance(planner_batch_size, int) or planner_batch_size < 1:
            raise ConfigurationError(f"ETTStrategy(planner_batch_size={planner_batch_size!r}): expected an int >= 1.")
        self.sharding_type = sharding_type
        self.constraints = dict(constraints or {})
        self._user_sharders = sharders
        self._user_plan = plan
        self._user_topology = topology
        self.fused_optimizer = fused_optimizer
        self.fused_optimizer_kwargs = dict(fused_optimizer_kwargs or {"lr": 0.01})
        self.plan_cache = PlanCache(plan_cache_dir) if plan_cache_dir is not None else None
        self.planner_batch_size = planner_batch_size
        self.overlap_startup = overlap_startup
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self.plan: ShardingPlan | None = None
        self.plan_source: str = "none"
        self._sharders: list[ModuleSharder[nn.Module]] = []
        self._dmp: DistributedModelParallel | None = None
        self._sigterm: sigterm.DeferredSigtermBroadcast | None = None
        self._patches = Patches()
        self.sharding_group_size = sharding_group_size
        self.replica_sync_every_n_steps = replica_sync_every_n_steps
        self.replica_lr_scale = replica_lr_scale
        self._group_size: int | None = None  # K in effect: None for 1D (also when K equals the world size)
        self._resolved_for: int | None = None  # the world size _group_size was checked against
        self._groups: ShardingGroups | None = None
        self.replica_sync: ReplicaSync | None = None
        self.pipeline = pipeline
        self.input_pipeline: Any = None  # a SparseInputPipeline while fitting (and after, for its counts)
        self.gc_freeze = StartupObjectsFrozen() if gc_freeze else None

    # ------------------------------------------------------------------ topology
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning for strategies it does not know: enables ``sync_dist`` and the distributed sampler."""
        return True

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._resolve_group_size()  # the first point where the world size is known: fail before any rank starts
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _resolve_group_size(self) -> None:
        world_size = self.num_nodes * self.num_processes
        if self._resolved_for == world_size:
            return
        self._group_size = validate_group_size(self.sharding_group_size, world_size)
        if self._group_size is None and self.replica_lr_scale != 1.0:
            rank_zero_warn(f"ETTStrategy(replica_lr_scale={self.replica_lr_scale!r}) has no effect: with "
                           f"sharding_group_size={self.sharding_group_size} on {world_size} ranks the job is 1D.")
        if self._group_size is not None:
            validate_2d_constraints(self.sharding_type, self.constraints, self._group_size)
        self._resolved_for = world_size

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ start-up
    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # selects the device (cuda.set_device on GPUs)
        check_fused_optimizer(self.fused_optimizer, self.root_device.type)
        reset_seed()
        self.set_world_ranks()
        # Lightning's launcher does not set it; TorchRec then assumes 8 ranks per host.
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(self.num_processes))
        self._resolve_group_size()
        self._process_group_backend = self._process_group_backend or default_backend(self.root_device)
        if self.overlap_startup:
            task = BackgroundTask(self._init_process_group, Phase.PROCESS_GROUP_INIT, name="ett-pg-init")
            try:
                self._startup_work()
            finally:
                task.join()
        else:
            with record_phase(Phase.PROCESS_GROUP_INIT):
                self._init_process_group()
            self._startup_work()
        self._check_ranks_agree_on_plan()

    def _init_process_group(self) -> None:
        assert self.cluster_environment is not None
        init_process_group(self.cluster_environment, self._process_group_backend, self.global_rank, self.world_size,
                           self.root_device, self._timeout)
        if self._group_size is not None and self._groups is None:
            self._groups = ShardingGroups.create(self._group_size, self.root_device.type, self.num_processes)

    def _startup_work(self) -> None:
        """Everything start-up needs that does not communicate: runs while the process group forms."""
        module = self.lightning_module
        assert module is not None
        if self._dmp is not None and self._dmp.module is module:
            return  # a later stage (validate/test after fit): the model is sharded already
        if is_overridden("configure_model", module):
            with record_phase(Phase.MODEL_INIT):
                module.configure_model()  # Lightning calls it again later: it must be idempotent, as Lightning requires
        tables = embedding_tables(module)
        with record_phase(Phase.SHARDING_PLAN):
            self.plan = self._resolve_plan(module, tables)
        hooks = [getattr(obj, OVERLAP_HOOK, None) for obj in (module, getattr(module.trainer, "datamodule", None))]
        hooks = [h for h in hooks if callable(h)]
        if hooks:
            with record_phase(Phase.DATA_INIT):
                for hook in hooks:
                    hook()

    def _resolve_plan(self, module: nn.Module, tables: dict[str, Any]) -> ShardingPlan | None:
        if self._group_size is not None:
            check_modules_2d(module)
        plan = self._find_plan(module, tables)
        if plan is not None and self._group_size is not None:
            check_plan_2d(plan, self._group_size, given=self.plan_source == "user")  # planner, cache or the user
        return plan

    def _find_plan(self, module: nn.Module, tables: dict[str, Any]) -> ShardingPlan | None:
        self._sharders = list(self._user_sharders) if self._user_sharders is not None \
            else default_sharders(self.root_device.type, two_d=self._group_size is not None)
        if not tables:
            self.plan_source = "none"
            return None
        constraints = self._constraints(tables)
        planned_ranks = self._group_size or self.world_size  # 2D: the planner plans one sharding group
        if self._user_plan is not None:
            check_plan_covers(self._user_plan, tables, "ETTStrategy(plan=...)")
            check_plan_ranks(self._user_plan, planned_ranks)
            self.plan_source = "user"
            return self._user_plan
        topology = self._user_topology or default_topology(
            planned_ranks, self.root_device.type, node_group_size(planned_ranks, self.num_processes, self.world_size))
        if topology.world_size != planned_ranks:
            raise ConfigurationError(f"ETTStrategy(topology=Topology(world_size={topology.world_size}, ...)): the planner plans "
                                     f"{planned_ranks} ranks here ({'the sharding group' if self._group_size else 'the world'}); "
                                     f"pass a Topology with world_size={planned_ranks}.")
        inputs = plan_inputs(tables_by_module(module), topology, self._sharders, constraints, self.planner_batch_size,
                             self._group_size)
        if self.plan_cache is not None:
            cached = self.plan_cache.load(inputs, tables)
            if cached is not None:
                self.plan_source = "cache"
                return cached
        try:
            plan = compute_plan(module, topology, self._sharders, constraints, self.planner_batch_size)
        except RuntimeError as e:
            explained = explain_no_sharding_type(e, self._sharders, constraints, set(self.constraints))
            if explained is None:
                raise
            raise ConfigurationError(explained) from e
        except PlannerError as e:
            if self._group_size is None:
                raise
            raise ConfigurationError(
                f"ETTStrategy(sharding_group_size={self._group_size}): TorchRec's planner found no plan for one group of "
                f"{self._group_size} ranks ({e}). In 2D it may use only the kernels the replica sync can average "
                f"({', '.join(SYNCED_KERNELS_2D)} for sharded tables; not fused_uvm_caching or key-value), and the group "
                f"holds every table. Give the planner the real memory (topology=TopologyFactory.create_topology("
                f"TrainerConfig(world_size={self._group_size}, hbm_cap_bytes=..., ddr_cap_bytes=...), kernel_config="
                "KernelConfig(compute_device=...))), a larger sharding_group_size, or sharding_group_size=None (1D).") from e
        self.plan_source = "planner"
        if self.plan_cache is not None and self.local_rank == 0:
            self.plan_cache.store(inputs, plan)
        return plan

    def _constraints(self, tables: dict[str, Any]) -> dict[str, ParameterConstraints]:
        validate_constraints(self.constraints, tables)
        constraints = dict(self.constraints)
        if self.sharding_type is not None:
            for name in tables:
                constraints.setdefault(name, ParameterConstraints(sharding_types=[self.sharding_type]))
        return constraints_2d(constraints, tables, self._group_size) if self._group_size is not None else constraints

    def _every_rank(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (this rank's alone in one process)."""
        if self.world_size < 2:
            return [value]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, value)
        return every

    def _check_ranks_agree_on_plan(self) -> None:
        """One tiny all-gather replaces the plan broadcast: catch ranks whose local plans differ."""
        if self.world_size < 2 or self.plan is None:
            return
        digests = self._every_rank(plan_digest(self.plan))
        if len(set(digests)) > 1:
            raise RuntimeError(
                f"ETTStrategy: ranks computed different sharding plans (digest per rank: {digests}). Give every rank "
                "the same model, constraints and world size, or pass the same `plan`/`plan_cache_dir`."
            )

    # ------------------------------------------------------------------ model and optimizers
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self.precision_plugin.convert_module(module)
        if self._dmp is not None and self._dmp.module is module:
            self.model = self._dmp  # sharded by an earlier stage of this Trainer
        else:
            self._replan_if_tables_changed(module)
            self._warn_if_dense_dtype_differs_from_the_embeddings()
            self._warn_of_data_parallel_sequence_tables(module)
            with _fbgemm_width_is_configuration():
                self._wrap(module)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._route_sharded_parameters()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        if trainer.accumulate_grad_batches > 1 and self.plan is not None:
            rank_zero_warn("ETTStrategy: the fused embedding optimizer steps in every backward; "
                           "`accumulate_grad_batches > 1` accumulates only the dense gradients.")

    def _warn_if_dense_dtype_differs_from_the_embeddings(self) -> None:
        """A "-true" precision converts the dense layers; TorchRec's sharded tables keep their configs' data_type and
        return float32 embeddings unless a table's plan sets another output dtype."""
        if isinstance(self.precision_plugin, HalfPrecision):
            dtype = self.precision_plugin._desired_input_dtype
        elif isinstance(self.precision_plugin, DoublePrecision):
            dtype = torch.float64
        else:
            return
        if self.plan is None:
            return
        tables = sorted(name for name, out in embedding_output_dtypes(self.plan).items() if out != dtype)
        if not tables:
            return
        other = "set their output dtype to it (ParameterConstraints(output_dtype=...)), " if dtype != torch.float64 else ""
        rank_zero_warn(f"ETTStrategy: precision={self.precision_plugin.precision!r} converts the dense layers to {dtype}, "
                       f"but TorchRec's sharded tables return their embeddings in another dtype (float32 unless set; "
                       f"{', '.join(tables[:5])}{', ...' if len(tables) > 5 else ''}): cast them before a dense layer "
                       f"(`emb.to({dtype})`) if your step does not already, {other}or use a mixed precision (e.g. "
                       "precision='bf16-mixed').")

    def _warn_of_data_parallel_sequence_tables(self, module: pl.LightningModule) -> None:
        tables = data_parallel_sequence_tables(self.plan, module) if self.plan is not None else []
        if tables:
            rank_zero_warn(f"ETTStrategy: EmbeddingCollection table(s) {', '.join(tables)} are sharded data_parallel; "
                           f"{EC_DATA_PARALLEL_FAILS}. Pass sharding_type='table_wise' or 'row_wise' (or constraints "
                           "for these tables) unless every feature has the same count.")

    def _replan_if_tables_changed(self, module: pl.LightningModule) -> None:
        """Tables built in ``setup()`` or by Lightning's ``configure_model`` call appear only after
        the overlap window: plan again (locally, and check again that all ranks agree)."""
        tables = embedding_tables(module)
        planned = planned_tables(self.plan) if self.plan is not None else set()
        if set(tables) == planned:
            return
        with record_phase(Phase.SHARDING_PLAN):
            self.plan = self._resolve_plan(module, tables)
        self._check_ranks_agree_on_plan()

    def _wrap(self, module: pl.LightningModule) -> None:
        """Shard the tables and wrap the rest in DDP (DMP's collectives: only after the join)."""
        if self.plan is None:
            rank_zero_warn("ETTStrategy: the model has no TorchRec embedding modules; it trains data-parallel (DDP through DMP).")
        with record_phase(Phase.MODEL_INIT):
            if self.plan is not None:
                apply_fused_optimizer(module, self.fused_optimizer, self._fused_kwargs())
            if self._groups is not None and self.plan is not None:
                self.model = self._dmp = shard_2d(module, self.plan, self._groups, self.root_device, self._sharders)
                self.replica_sync = ReplicaSync(self._dmp, self._groups.replica_pg, self._groups.num_replicas,
                                                self.replica_sync_every_n_steps)
                self.replica_sync.start_equal()  # (a checkpoint, if any, is loaded after this)
                return
            self.model = self._dmp = DistributedModelParallel(
                module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=self.root_device,
                plan=self.plan or ShardingPlan({}), sharders=self._sharders, init_data_parallel=True, init_parameters=True,
            )

    def _fused_kwargs(self) -> dict[str, Any]:
        """The fused optimizer's hyper-parameters, its learning rate scaled by ``replica_lr_scale`` in 2D."""
        if self._groups is None:
            return self.fused_optimizer_kwargs
        factor = replica_lr_factor(self.replica_lr_scale, self.fused_optimizer, self._groups.num_replicas)
        if factor == 1.0:
            return self.fused_optimizer_kwargs
        lr = self.fused_optimizer_kwargs.get("lr", default_lr(self.fused_optimizer))
        rank_zero_info(f"ETTStrategy(replica_lr_scale={self.replica_lr_scale!r}): the tables' {self.fused_optimizer} "
                       f"learning rate is {lr} x {factor:g} = {lr * factor:g} in 2D ({self._groups.num_replicas} replicas).")
        return {**self.fused_optimizer_kwargs, "lr": lr * factor}

    @override
    def model_to_device(self) -> None:
        """Nothing to do: DMP allocates each table shard on the device and moves the dense part
        there when it builds its DDP wrapper."""

    def _route_sharded_parameters(self) -> None:
        """Drop the tables from the user's optimizers: the fused optimizer updates them in backward."""
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                kept = []
                for param in group["params"]:
                    if hasattr(param, "_in_backward_optimizers"):
                        optimizer.state.pop(param, None)  # eager optimizers (Adagrad) built state for the tables too
                    else:
                        kept.append(param)
                group["params"] = kept
            if not any(group["params"] for group in optimizer.param_groups):
                rank_zero_warn(f"ETTStrategy: {type(optimizer).__name__} from configure_optimizers holds only embedding "
                               "tables, which the fused optimizer already updates; it has nothing left to step.")

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.replica_sync is not None:
            assert self.lightning_module is not None
            # Lightning counts the step after the optimizer's: this one completes global step + 1.
            self.replica_sync.after_optimizer_step(self.lightning_module.trainer.global_step + 1)
        return output

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self.input_pipeline is not None and self.lightning_module is not None:
            taken, prepared = self.input_pipeline.take(batch, self.lightning_module, dataloader_idx)
            if taken:  # on the device since the last step, its ids already sent
                return prepared
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.replica_sync is not None:
            # The fused optimizer moves this replica's rows in whatever backward this batch runs: Lightning's, a
            # manual_backward, or a plain loss.backward() under manual optimization (Lightning sees only the first two).
            self.replica_sync.mark_changed()
        if self.input_pipeline is None or not self.input_pipeline.active:
            return super().training_step(*args, **kwargs)
        assert self.lightning_module is not None
        batch = args[0] if args else kwargs.get("batch")
        self.input_pipeline.before_step(self.lightning_module.trainer, batch)
        output = super().training_step(*args, **kwargs)
        self.input_pipeline.after_step(batch)
        return output

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        if self.input_pipeline is not None:
            self.input_pipeline.before_backward()  # the next batch's ids travel during this backward

    def sync_replicas(self) -> None:
        """2D: average the table replicas now unless no training batch ran since the last average.

        Collective on every rank. Called before anything reads the tables as one model: a
        checkpoint (and so a publish), validation, test, predict and the end of fit.
        """
        if self.replica_sync is not None:
            self.replica_sync.sync()

    @override
    def on_validation_start(self) -> None:
        self.sync_replicas()  # between syncs (replica_sync_every_n_steps > 1) each group would evaluate its own copy

    @override
    def on_test_start(self) -> None:
        self.sync_replicas()

    @override
    def on_predict_start(self) -> None:
        self.sync_replicas()

    @property
    def fused_optimizer_instance(self) -> Any:
        """TorchRec's keyed optimizer over the sharded tables (``None`` before setup or without tables)."""
        return self._dmp.fused_optimizer if self._dmp is not None and self.plan is not None else None

    def _parameter_names(self) -> dict[int, str]:
        assert self.lightning_module is not None
        return {id(p): name for name, p in self.lightning_module.named_parameters()}

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if "nccl" in dist.get_backend():
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src, group=dist.group.WORLD)
        return holder[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        from lightning.fabric.utilities.distributed import _sync_ddp_if_available

        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op) if isinstance(tensor, Tensor) else tensor

    # ------------------------------------------------------------------ checkpoints (DCP)
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded targets exist only once DMP has sharded the model

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return self.model.state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return ckpt.name_keyed_optimizer_state(optimizer, self._parameter_names())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("ETTStrategy.save_checkpoint(storage_options=...) is not supported: DCP writes the files.")
        checkpoint = dict(checkpoint)
        tensors = self.dcp_checkpoint_tensors(checkpoint)
        ckpt.save_sharded(tensors, checkpoint, filepath, self.global_rank, lambda obj: self.broadcast(obj, src=0))

    def dcp_checkpoint_tensors(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Take the sharded parts out of a Lightning ``checkpoint`` (in place) for a collective DCP write.

        Returns ``{"model": ..., "fused": ...}`` (sharded tables as ShardedTensors; the fused
        optimizer's state unless this is a weights-only checkpoint); what stays in
        ``checkpoint`` goes to ``lightning.pt``. AsyncCheckpoint calls this too: its presence
        tells it that every rank must take part in the write.
        """
        assert self.model is not None
        self.sync_replicas()  # 2D: a checkpoint holds one copy of each shard, the replicas' average
        tensors = {"model": checkpoint.pop(ckpt.MODEL_KEY, None) or self.model.state_dict()}
        fused = self.fused_optimizer_instance
        if fused is not None and ckpt.DENSE_KEY in checkpoint:  # a weights-only save carries no optimizer state
            tensors["fused"] = fused.state_dict()
            checkpoint[ckpt.FUSED_NAME_KEY] = self.fused_optimizer
        if self._groups is not None:
            tensors = spread_over_replicas(tensors, self._groups)  # each rank writes 1/N of the tables
        return tensors

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return ckpt.load_meta(checkpoint_path)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        assert self.model is not None
        with record_phase(Phase.CHECKPOINT_LOAD):
            ckpt.load_model(checkpoint["ett_checkpoint_dir"], self.model, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        fused = self.fused_optimizer_instance
        with record_phase(Phase.CHECKPOINT_LOAD):
            if fused is not None and self._fused_state_carries_over(checkpoint):
                # Each rank names its own tables (a table's fused state lives on the ranks that hold its shards).
                fresh = sorted({name for names in self._every_rank(ckpt.load_fused(checkpoint["ett_checkpoint_dir"], fused))
                                for name in names})
                if fresh:
                    rank_zero_warn(f"ETTStrategy: the checkpoint {str(checkpoint['ett_checkpoint_dir'])!r} holds no "
                                   f"embedding optimizer state for {_some(fresh)} (data-parallel when it was saved, "
                                   f"or new): their {self.fused_optimizer} state starts afresh.")
            names = self._parameter_names()
            for optimizer, saved in zip(self.optimizers, checkpoint.get(ckpt.DENSE_KEY, [])):
                new, left = ckpt.load_name_keyed_optimizer_state(optimizer, saved, names)
                where = str(checkpoint["ett_checkpoint_dir"])
                if new:
                    rank_zero_warn(f"ETTStrategy: the checkpoint {where!r} holds no {type(optimizer).__name__} state "
                                   f"for {_some(new)} (sharded when it was saved, or new): their state starts afresh.")
                if left:
                    rank_zero_warn(f"ETTStrategy: the checkpoint {where!r} holds {type(optimizer).__name__} state for "
                                   f"{_some(left)}, which {type(optimizer).__name__} no longer holds (now sharded, "
                                   "under the fused optimizer, or gone): left behind.")

    def _fused_state_carries_over(self, checkpoint: dict[str, Any]) -> bool:
        """Whether to load the checkpoint's fused optimizer state: yes under the optimizer it was saved with.

        Another one's state means something else (Adam's first moment would load as AdaGrad's sum, same shape),
        so a switch between two optimizers that keep state is refused. A switch from or to ``sgd``, which keeps
        none, loses nothing or leaves the old state behind: it goes on, warned. A checkpoint that names no
        optimizer (saved before this record) is loaded; a mismatch there fails on the state's keys or shapes
        (:func:`ckpt.load_fused`).
        """
        saved = checkpoint.get(ckpt.FUSED_NAME_KEY)
        if saved is None or saved == self.fused_optimizer:
            return True
        where, now = str(checkpoint["ett_checkpoint_dir"]), self.fused_optimizer
        if saved == "sgd":
            rank_zero_warn(f"ETTStrategy(fused_optimizer={now!r}): the checkpoint {where!r} was saved with "
                           f"fused_optimizer='sgd', which keeps no state: {now}'s embedding optimizer state starts fresh.")
        elif now == "sgd":
            rank_zero_warn(f"ETTStrategy(fused_optimizer='sgd'): the checkpoint {where!r} was saved with "
                           f"fused_optimizer={saved!r}; its embedding optimizer state is left behind (SGD keeps none).")
        else:
            raise ConfigurationError(
                f"ETTStrategy(fused_optimizer={now!r}): the checkpoint {where!r} was saved with "
                f"fused_optimizer={saved!r}, whose embedding optimizer state does not carry over to {now!r} (each keeps "
                f"state of its own meaning). Resume with ETTStrategy(fused_optimizer={saved!r}); or, to leave "
                "that state behind, resume with 'sgd', or start afresh (AsyncCheckpoint(resume=False) or another "
                "dirpath).")
        return False

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            retire(Path(filepath))  # renamed first: a half-deleted checkpoint never keeps its name

    @override
    def on_train_start(self) -> None:
        assert self.lightning_module is not None
        # Lightning has registered its signal handlers by now.
        self._sigterm = sigterm.install(self.lightning_module.trainer, self._patches)  # no collective + .item() per step
        if self.pipeline and self._dmp is not None:
            try:  # TorchRec's train-pipeline parts, as of the tested 1.9 (older releases laid them out otherwise)
                from lightning_ett.strategies.input_pipeline import SparseInputPipeline
            except ImportError as e:
                rank_zero_warn(f"ETTStrategy(pipeline=True): this TorchRec lacks the train-pipeline parts the pipeline "
                               f"uses ({e}); training unpipelined. Tested with torchrec 1.9.")
            else:
                self.input_pipeline = SparseInputPipeline(self._dmp, self.root_device, self._all_ranks_agree)
                self.input_pipeline.attach(self.lightning_module.trainer)
        if self.gc_freeze is not None:  # last: start-up is over (every rank reaches this before its first step)
            self.gc_freeze.freeze()

    def _all_ranks_agree(self, flags: list[bool]) -> list[bool]:
        """Each flag AND-ed over all ranks (a MIN all-reduce on the device the process group serves)."""
        tensor = torch.tensor([int(flag) for flag in flags], dtype=torch.int32, device=self.root_device)
        return [bool(value) for value in self.reduce(tensor, reduce_op="min").tolist()]

    @override
    def on_train_end(self) -> None:
        if self.input_pipeline is not None:  # wait for a batch prepared past the last step; forwards back for eval
            self.input_pipeline.detach()  # kept: its counts describe the fit that ended
        self.sync_replicas()  # 2D: what fit leaves behind (eval, predict, a final save) is one model
        if self.replica_sync is not None and self._groups is not None and self.is_global_zero:
            sync = self.replica_sync
            factor = replica_lr_factor(self.replica_lr_scale, self.fused_optimizer, self._groups.num_replicas)
            get_timeline().fact(SPARSE_2D_FACT, sharding_group_size=self._groups.size, world_size=self._groups.world_size,
                                replicas=self._groups.num_replicas, every_n_steps=sync.every_n_steps, syncs=sync.syncs,
                                lr_factor=factor,
                                payload_bytes=sync.nbytes, sync_s=sync.seconds)
        if self._sigterm is not None:
            self._sigterm.flush()  # no asynchronous broadcast left outstanding
        self._patches.undo()

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self.gc_freeze is not None:  # first: the flush below waits on peers and may raise
            self.gc_freeze.unfreeze()
        if self.input_pipeline is not None:  # no waiting on peers that may be gone: only the forwards go back
            self.input_pipeline.release()
        if self._sigterm is not None:
            self._sigterm.flush()
        self._patches.undo()

    @override
    def teardown(self) -> None:
        # Unlike Strategy.teardown, leave the model where it is: sharded TorchRec modules do not move.
        if self.gc_freeze is not None:
            self.gc_freeze.unfreeze()  # (not at on_train_end: a fit may run its fit loop again, see gc_freeze)
        if self.lightning_module is not None:
            self.model = self.lightning_module
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


@contextmanager
def _fbgemm_width_is_configuration() -> Iterator[None]:
    """TorchRec asserts, while sharding, that every table's (or column shard's) width is a multiple of 4, which
    FBGEMM's kernels need: a model that fails so fails on every attempt, so it is raised as a
    :class:`ConfigurationError` (``lightning run`` does not retry it), saying what to change."""
    try:
        yield
    except AssertionError as e:
        if "not divisible by 4" not in str(e):
            raise
        raise ConfigurationError(
            f"ETTStrategy cannot shard this model's tables: {e}. Give every EmbeddingBagConfig/EmbeddingConfig an "
            "embedding_dim that is a multiple of 4; for column_wise sharding, also a min_partition that is one "
            "(ETTStrategy(constraints=...)).") from e


def _some(names: list[str], shown: int = 5) -> str:
    """The first few ``names`` for a message, and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
