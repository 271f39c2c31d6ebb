"""One attempt of the reference job for e2e_ett.py: the example DLRM on 2 CPU ranks, either arm.

* ``--arm pack``: ETTStrategy (table-wise, fused row-wise Adagrad, plan cache), ETTMonitor,
  AsyncCheckpoint every K steps keeping the last one, as the baselines' ``save_top_k=1`` (resumes
  by itself), CompileCache, DynamicShapes (unless ``--no-dynamic-shapes``). Started by
  ``lightning run``, which restarts it.
* ``--arm vanilla``: stock Lightning: DDP, synchronous ``ModelCheckpoint`` every K steps
  (``save_top_k=1, save_last="link"``: one write per save), ``--resume`` restarts from
  ``last.ckpt`` if there is one; ETTMonitor only measures. Started by torchrun.
* ``--arm same``: the pack's training without its ETT machinery: the pack's ETTStrategy, the
  vanilla arm's synchronous ``ModelCheckpoint`` (one sharded DCP write per save) and ``--resume``,
  no CompileCache or DynamicShapes; ETTMonitor only measures. Started by torchrun.

Both compile the dense parts of the model (``DLRMModule(compile_dense=True)``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def zipf_data(data, rows: int, alpha: float):  # type: ignore[no-untyped-def]
    """``data``'s training batches with each uniform id mapped through a Zipf law's inverse CDF (id_streams.py)."""
    from torch.utils.data import DataLoader, IterableDataset
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from benchmarks.id_streams import ZipfLaw

    law = ZipfLaw(rows, alpha)

    class Zipfed(IterableDataset):
        def __init__(self, inner: DataLoader) -> None:
            self.inner = inner

        def __iter__(self):  # type: ignore[no-untyped-def]
            for b in self.inner:
                kjt = b.sparse_features
                ids = KeyedJaggedTensor(keys=kjt.keys(), values=law.from_uniform_ids(kjt.values()), lengths=kjt.lengths())
                yield Batch(dense_features=b.dense_features, sparse_features=ids, labels=b.labels)

    uniform_loader = data.train_dataloader
    data.train_dataloader = lambda: DataLoader(Zipfed(uniform_loader()), batch_size=None)
    return data


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arm", choices=["pack", "same", "vanilla"], required=True)
    p.add_argument("--work", required=True, help="checkpoints, caches and the run dir live here")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=lambda v: v if v == "auto" else int(v), default=100,
                   help="checkpoint interval in steps; pack: or 'auto' (Young/Daly, cadence.py)")
    p.add_argument("--mtbf-hours", type=float, default=None, help="pack, --every auto: the MTBF (default: from the ledger)")
    p.add_argument("--publish", action="store_true", help="pack: add ModelPublisher(WORK/serving, submodule='model')")
    p.add_argument("--num-embeddings", type=int, default=20_000)
    p.add_argument("--incremental", action="store_true", help="pack: AsyncCheckpoint(incremental=True)")
    p.add_argument("--fresh-batches", action="store_true",
                   help="every batch new (default: the data module cycles 10 batches, so saves see few changed rows)")
    p.add_argument("--zipf", type=float, default=None,
                   help="ids from a truncated Zipf law of this exponent over each table (default: uniform)")
    p.add_argument("--no-dynamic-shapes", action="store_true",
                   help="pack: leave DynamicShapes out (e2e_ett.py: its batches are all one size, and the other "
                        "arms compile without it, so the pack must too for identical work)")
    p.add_argument("--compile-cache", default=None, help="pack: CompileCache directory (default WORK/compile_cache)")
    p.add_argument("--resume", action="store_true", help="vanilla: restart from last.ckpt")
    p.add_argument("--pg-timeout-s", type=float, default=None,
                   help="vanilla: DDPStrategy(timeout=...) instead of Lightning's default 30 min (hang_recovery.py)")
    args = p.parse_args()
    work = Path(args.work)

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from examples.dlrm_example import DLRMModule, RandomCriteoDataModule
    from lightning_ett import AsyncCheckpoint, CompileCache, DynamicShapes, ETTMonitor, ETTStrategy, ModelPublisher

    def ett_strategy() -> ETTStrategy:
        return ETTStrategy(sharding_type="table_wise", fused_optimizer="row_wise_adagrad",
                           fused_optimizer_kwargs={"lr": 0.05}, plan_cache_dir=str(work / "plan_cache"))

    if args.arm == "pack":
        strategy = ett_strategy()
        callbacks = [ETTMonitor(report_on_end=False),
                     AsyncCheckpoint(work / "ckpt", every_n_train_steps=args.every, keep_last_n=1, incremental=args.incremental,
                                     **({"mtbf_hours": args.mtbf_hours} if args.every == "auto" else {})),
                     CompileCache(args.compile_cache or work / "compile_cache"),
                     *([] if args.no_dynamic_shapes else [DynamicShapes()])]
        if args.publish:
            callbacks.append(ModelPublisher(work / "serving", submodule="model", metrics=["loss"]))
    else:
        from datetime import timedelta

        from lightning.pytorch.strategies import DDPStrategy

        if args.arm == "same":
            strategy = ett_strategy()
        else:
            strategy = DDPStrategy(timeout=timedelta(seconds=args.pg_timeout_s)) if args.pg_timeout_s else "ddp"
        callbacks = [ETTMonitor(run_dir=work / "run", report_on_end=False),
                     ModelCheckpoint(dirpath=work / "ckpt", every_n_train_steps=args.every, save_top_k=1,
                                     save_last="link")]  # one write per save
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                      callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      num_sanity_val_steps=0)
    model = DLRMModule(num_embeddings=args.num_embeddings, compile_dense=True)
    data = RandomCriteoDataModule(batch_size=512, num_embeddings=args.num_embeddings,
                                  num_generated_batches=-1 if args.fresh_batches else 10)
    if args.zipf is not None:
        data = zipf_data(data, args.num_embeddings, args.zipf)
    ckpt_path = "last" if args.resume and (work / "ckpt" / "last.ckpt").exists() else None
    trainer.fit(model, data, ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()
