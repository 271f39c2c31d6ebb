"""TorchRec sharders and the fused (in-backward) embedding optimizer that ETTStrategy uses."""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner.utils import sharder_name
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import EmbeddingConfig, data_type_to_dtype
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from lightning_ett.durable.errors import ConfigurationError
from lightning_ett.strategies.plan_cache import embedding_modules, tables_by_module

FUSED_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "row_wise_adagrad": RowWiseAdagrad,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
}


#: fbgemm's CPU embedding kernels (``use_cpu``) implement only these; its Adam is CUDA-only.
CPU_FUSED_OPTIMIZERS = ("row_wise_adagrad", "adagrad", "sgd")


def check_fused_optimizer(name: str, device_type: str) -> None:
    """Fail before start-up, naming the argument, where fbgemm would assert deep inside DMP's sharding."""
    if device_type == "cpu" and name not in CPU_FUSED_OPTIMIZERS:
        raise ConfigurationError(f"ETTStrategy(fused_optimizer={name!r}) is not supported on CPU: fbgemm's CPU embedding kernels "
                                 f"implement {', '.join(CPU_FUSED_OPTIMIZERS)} only ({name} needs CUDA). Pass one of those.")


class CPURowWiseEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EBC sharder, offering row-wise and table-row-wise sharding on CPU too (TorchRec limits them to
    cuda/mtia; fbgemm's CPU kernels run them), and with ``grid`` grid sharding (2D only: TorchRec's 1D grid fails on
    a single host). tests/distributed/test_sparse_2d.py trains each."""

    def __init__(self, grid: bool = False) -> None:
        super().__init__()
        self.grid = grid

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = list(super().sharding_types(compute_device_type))
        if compute_device_type == "cpu":
            extra = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE) + ((ShardingType.GRID_SHARD,) if self.grid else ())
            types += [t.value for t in extra if t.value not in types]
        return types


def default_sharders(compute_device_type: str, two_d: bool = False) -> list[ModuleSharder[nn.Module]]:
    sharders = get_default_sharders()
    if compute_device_type != "cpu":
        return sharders
    return [CPURowWiseEmbeddingBagCollectionSharder(grid=two_d) if type(s) is EmbeddingBagCollectionSharder else s
            for s in sharders]


def default_lr(name: str) -> float:
    """The learning rate ``FUSED_OPTIMIZERS[name]`` uses when ``fused_optimizer_kwargs`` gives none."""
    return float(inspect.signature(FUSED_OPTIMIZERS[name]).parameters["lr"].default)


def apply_fused_optimizer(module: nn.Module, name: str, kwargs: dict[str, Any]) -> None:
    """Fuse the table optimizer into backward (once; a second setup must not stack another)."""
    subs = embedding_modules(module)
    frozen = [name for sub in subs for name, p in sub.named_parameters() if not p.requires_grad]
    if frozen:
        raise ConfigurationError(
            f"ETTStrategy: embedding table parameter(s) {frozen[:3]}{' ...' if len(frozen) > 3 else ''} have "
            "requires_grad=False. Frozen tables are not supported: the fused optimizer updates every sharded table in "
            "backward. Keep the tables trainable (freeze the dense layers only), or train without ETTStrategy.")
    params = [p for sub in subs for p in sub.parameters() if not hasattr(p, "_in_backward_optimizers")]
    if params:
        apply_optimizer_in_backward(FUSED_OPTIMIZERS[name], params, kwargs)


#: TorchRec's enumerator, when no sharding type (and kernel) is left for a table (``planner/enumerators.py``).
_NO_SHARDING_TYPE = re.compile(r"No available sharding type and compute kernel combination after applying user provided "
                               r"constraints for (?P<table>.+?)\. Module: (?P<module>[\w.]+), sharder: (?P<sharder>\w+), "
                               r"compute device: (?P<device>\w+)")


#: The TorchRec limitation both the planner's error and the data_parallel warning name.
EC_DATA_PARALLEL_FAILS = ("data_parallel for an EmbeddingCollection fails inside TorchRec 1.9.2 at the first forward "
                          "(`split_with_sizes` in construct_jagged_tensors) when its features' id counts in a batch differ")


def explain_no_sharding_type(error: Exception, sharders: list[ModuleSharder[nn.Module]],
                             constraints: dict[str, Any], user_constrained: set[str]) -> str | None:
    """What to do when TorchRec's planner found no sharding type for a table because its constraints ask only for types
    its sharder does not offer on the device (e.g. ``table_row_wise`` for an ``EmbeddingCollection`` on CPU); ``None``
    for any other error, which is then raised as TorchRec raised it.

    Read from TorchRec's own error, not checked before planning: only the planner knows which sharder takes which
    module (a wrapper such as ``FeatureProcessedEmbeddingBagCollection`` has its own) and which tables it skips."""
    match = _NO_SHARDING_TYPE.search(str(error))
    if match is None:
        return None
    # the sharder TorchRec used: its map by module type keeps the last sharder given for a type
    sharder = next((s for s in reversed(sharders) if sharder_name(s.module_type) == match["module"]
                    and type(s).__name__ == match["sharder"]), None)
    if sharder is None:
        return None
    table, device, module = match["table"], match["device"], match["module"].rsplit(".", 1)[-1]
    offered = list(sharder.sharding_types(device))
    asked = list(getattr(constraints.get(table), "sharding_types", None) or [])
    if not asked or set(asked) & set(offered):
        return None  # the types are offered: a compute-kernel constraint left nothing, which TorchRec's error says
    hints = []
    if ShardingType.GRID_SHARD.value in asked and isinstance(sharder, CPURowWiseEmbeddingBagCollectionSharder) \
            and not sharder.grid:
        hints.append("grid_shard on CPU needs 2D sparse parallelism (sharding_group_size=K)")
    if module == "EmbeddingCollection" and ShardingType.DATA_PARALLEL.value in offered:
        hints.append(f"{EC_DATA_PARALLEL_FAILS}: see the README's Known limitations")
    fix = (f"Give constraints[{table!r}] sharding_types" if table in user_constrained else  # they replace sharding_type
           f"Pass sharding_type= (or constraints={{{table!r}: ParameterConstraints(sharding_types=[...])}})")
    return (f"ETTStrategy: table {table!r} ({module}) is constrained to sharding type(s) {asked}, but {match['sharder']} "
            f"offers only {offered} on {device}. {fix} with one of those, or sharders=[...] that offer it"
            + (f" ({'; '.join(hints)})." if hints else "."))


def data_parallel_sequence_tables(plan: ShardingPlan, module: nn.Module) -> list[str]:
    """Tables of an ``EmbeddingCollection`` planned ``data_parallel`` (:data:`EC_DATA_PARALLEL_FAILS`); said before
    the first step, not after."""
    tables = []
    for path, config in tables_by_module(module):
        sharding = plan.plan.get(path, {}).get(config.name)  # type: ignore[union-attr]
        if isinstance(config, EmbeddingConfig) and sharding is not None and (
                sharding.sharding_type == ShardingType.DATA_PARALLEL.value):
            tables.append(config.name)
    return sorted(tables)


def embedding_output_dtypes(plan: ShardingPlan) -> dict[str, torch.dtype]:
    """The dtype each planned table's embeddings come out in: its plan's (``ParameterConstraints.output_dtype``), else
    float32. Not a sharder's ``fused_params["output_dtype"]``: on CPU (fbgemm 1.8, TorchRec 1.9.2) a table-wise table
    still returned float32 with it (tests/scripts/precision_job.py's ``fused`` case), so it cannot vouch for one."""
    return {name: data_type_to_dtype(sharding.output_dtype) if sharding.output_dtype is not None else torch.float32
            for module_plan in plan.plan.values() for name, sharding in module_plan.items()}  # type: ignore[union-attr]
