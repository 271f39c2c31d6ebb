"""One rank of ETTStrategy training a small sharded model, once per case (real TorchRec, gloo).

Each case is ``PRECISION`` followed by options, ``:``-separated:
``cast``: the model casts the embeddings to its own dtype before its dense layer;
``ec``: an EmbeddingCollection instead of an EmbeddingBagCollection;
``out``: the table's output dtype set to the precision's (fbgemm's CPU kernels have fp16, not bf16);
``fused``: fp16 output set in the sharder's fused params instead;
any other: a sharding type (``sharding_type=`` for every table).
For each it writes to OUT/<case>.json (``:`` as ``_``): the strategy's warnings, the dtypes and steps
trained, and the error if fit failed.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints
from torchrec.types import DataType

from lightning_ett import ETTStrategy


def batches(n: int, size: int = 16) -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=torch.randint(0, 50, (size,), generator=g),
                                                 lengths=torch.ones(size, dtype=torch.int32)),
             torch.randn(size, generator=g)) for _ in range(n)]


class Tiny(LightningModule):
    def __init__(self, cast: bool, sequence: bool) -> None:
        super().__init__()
        self.cast, self.sequence = cast, sequence
        meta = torch.device("meta")
        self.ebc = EmbeddingCollection(tables=[EmbeddingConfig(name="t0", embedding_dim=8, num_embeddings=50,
                                                               feature_names=["f0"])], device=meta) if sequence else \
            EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=50,
                                                              feature_names=["f0"])], device=meta)
        self.dense = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        kjt, y = batch
        out = self.ebc(kjt)["f0"]
        emb = out.values() if self.sequence else out  # one id per sample: a sequence is its one row
        if self.cast:
            emb = emb.to(self.dense.weight.dtype)
        return torch.nn.functional.mse_loss(self.dense(emb).squeeze(-1).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(batches(8), batch_size=None)


def run(case: str) -> dict:
    precision, *options = case.split(":")
    sharding_type = next((o for o in options if o not in ("cast", "ec", "out", "fused")), None)
    model = Tiny(cast="cast" in options, sequence="ec" in options)
    # "out": the table's output dtype set to the precision's (TorchRec's ParameterConstraints.output_dtype)
    output = {"t0": ParameterConstraints(output_dtype=DataType.BF16 if "bf16" in precision else DataType.FP16)}
    # "fused": fp16 output set in the sharder's fused params instead
    sharders = [EmbeddingBagCollectionSharder(fused_params={"output_dtype": SparseType.FP16})] if "fused" in options else None
    strategy = ETTStrategy(sharding_type=sharding_type, constraints=output if "out" in options else None, sharders=sharders)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision,
                      max_steps=6, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    result: dict = {"case": case, "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model)
        except (RuntimeError, ValueError) as err:  # recorded: the test asserts which case fails and how
            result["error"] = f"{type(err).__name__}: {err}"
    result["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("ETTStrategy:")]
    if result["error"] is None:
        table = next(v for k, v in model.ebc.state_dict().items() if k.endswith("t0.weight"))
        local = table.local_shards()[0].tensor if hasattr(table, "local_shards") else table
        result["dense_dtype"] = str(model.dense.weight.dtype)
        result["table_dtype"] = str(local.dtype)
        result["steps"] = trainer.global_step
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="32-true,bf16-mixed,bf16-true:cast,bf16-true,16-true:out,16-true:fused,64-true:cast,"
                                        "32-true:ec:row_wise,"
                                        "32-true:ec:table_row_wise,"
                                        "32-true:ec:data_parallel")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for case in args.cases.split(","):
        (out / f"{case.replace(':', '_')}.json").write_text(json.dumps(run(case)))


if __name__ == "__main__":
    main()
