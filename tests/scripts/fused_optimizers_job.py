"""One rank of ETTStrategy training the sharded DLRM once per fused optimizer (real TorchRec, gloo).

For each optimizer it writes to OUT/<name>.json whether the tables moved, the first and last
losses, and the state the fused optimizer keeps. ``--accumulate`` trains the last one with
``accumulate_grad_batches=2`` (the strategy warns that only dense gradients accumulate).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from ett_job import ShardedDLRM, Steps, local_state
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_ett import ETTStrategy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--optimizers", default="adagrad,sgd,adam")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--accumulate", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.optimizers.split(",")
    for name in names:
        strategy = ETTStrategy(sharding_type="table_wise", fused_optimizer=name, fused_optimizer_kwargs={"lr": 0.1})
        accumulate = 2 if args.accumulate and name == names[-1] else 1
        trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps, logger=False,
                          enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                          limit_val_batches=0, num_sanity_val_steps=0, accumulate_grad_batches=accumulate)
        model = ShardedDLRM(rows=20, batch=32)
        before = None

        def on_train_start(trainer: Trainer, module: ShardedDLRM) -> None:
            nonlocal before
            before = {k: v for k, v in local_state(module).items() if "embedding_bags" in k}

        from lightning.pytorch.callbacks import LambdaCallback

        trainer.callbacks.append(LambdaCallback(on_train_start=on_train_start))
        trainer.fit(model, DataLoader(Steps(), batch_size=None))
        after = {k: v for k, v in local_state(model).items() if "embedding_bags" in k}
        fused = strategy.fused_optimizer_instance
        state_keys = sorted({key.rsplit(".", 1)[-1] for key in _flat(fused.state_dict()["state"])})
        (out / f"{name}.json").write_text(json.dumps({
            "tables": len(after),
            "tables_moved": all(not torch.equal(before[k], after[k]) for k in after),
            "first_loss": sum(model.losses[:5]) / 5, "last_loss": sum(model.losses[-5:]) / 5,
            "fused_state": state_keys, "fused_type": type(fused).__name__,
        }))


def _flat(state: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in state.items():
        keys += _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


if __name__ == "__main__":
    main()
