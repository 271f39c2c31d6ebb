"""A Lightning job whose model is torch.compile-d, fed a stream of varying batch sizes.

Writes the compile counts (from lightning_ett's Dynamo callback tracker) to OUT/compile.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_ett import CompileCache, DynamicShapes, ETTMonitor
from lightning_ett.instrument.compile_events import compile_tracker


class Batches(Dataset):
    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.sizes[i], 16, generator=g)
        return {"features": x, "target": x.sum(-1)}


class Compiled(LightningModule):
    def __init__(self, backend: str, width: int = 64) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        self.compiled = torch.compile(self.net, backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        net = self if self.compile_self else self.compiled  # compile_self: CompileCache compiled the module
        return torch.nn.functional.mse_loss(net(batch["features"]).squeeze(-1), batch["target"])

    compile_self = False

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", default="512,512,300,512,177")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--dynamic-shapes", action="store_true")
    p.add_argument("--compile-cache", default=None, help="CompileCache(cache_dir=...)")
    p.add_argument("--width", type=int, default=64, help="another width is another model")
    p.add_argument("--compile-module", action="store_true", help="CompileCache(compile_module=True) compiles the module")
    args = p.parse_args()
    out = Path(args.out)
    sizes = [int(s) for s in args.sizes.split(",")]
    callbacks = [ETTMonitor(run_dir=out / "ett", report_on_end=False)]
    if args.dynamic_shapes:
        callbacks.append(DynamicShapes(log_every_n_steps=1))
    cache = None
    if args.compile_cache:
        cache = CompileCache(args.compile_cache, compile_module=args.compile_module,
                             compile_kwargs={"backend": args.backend} if args.compile_module else None)
    if cache is not None:
        callbacks.append(cache)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=callbacks,
                      logger=CSVLogger(out, name="csv", version=0),
                      log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    tracker = compile_tracker()
    model = Compiled(args.backend, args.width)
    model.compile_self = args.compile_module
    trainer.fit(model, DataLoader(Batches(sizes), batch_size=None, shuffle=False))
    (out / "compile.json").write_text(json.dumps({"recompiles": tracker.recompiles, "graphs": tracker.compiles,
                                                  "seconds": tracker.seconds, "steps": trainer.global_step,
                                                  "cache": cache.metrics() if cache else None,
                                                  "loaded": cache.loaded if cache else None}))


if __name__ == "__main__":
    main()
