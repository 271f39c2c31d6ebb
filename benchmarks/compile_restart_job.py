"""One attempt of a compiled job with CompileCache, run under `lightning run` by compile_restart.py.

``--model dlrm``: the example DLRM (1 CPU process), compiled by CompileCache(compile_module=True).
``--model mlp``: a user's own LightningModule: an MLP whose ``self.net = torch.compile(...)``,
trained on batches of several sizes with DynamicShapes() and CompileCache(cache_dir=...).

``--host fresh``: each attempt (``LIGHTNING_ETT_ATTEMPT``) first points ``TORCHINDUCTOR_CACHE_DIR``
at a new, empty directory under ``--default-inductor-root``, before anything compiles: what a
restart on another host has (compile_restart.py also gives it a new launcher and an empty
``TMPDIR``, where inductor keeps its precompiled header); only ``--cache-dir`` (shared storage)
carries over. ``--host same``: every attempt uses one default inductor directory, as restarts on
one host do. ``--no-cache``: the control, without CompileCache (DLRM: ``module.compile()`` as
CompileCache(compile_module=True) would call it). ETTMonitor records each step in the job's
ledger and SIGKILLs the worker where ``LIGHTNING_ETT_FAULT_KILL`` says. At the end of its first
step the attempt writes its compile counters and the time ``fit`` was called to
``OUT/attempt-N.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FEATURES = 64
SIZES = (256, 192, 320, 128)  # the batch sizes, in turn


def mlp_job(width: int):  # type: ignore[no-untyped-def]
    """A user-style compiled LightningModule and a loader of batches of several sizes."""
    import torch
    from lightning.pytorch import LightningModule
    from torch.utils.data import DataLoader, Dataset

    class Batches(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            x = torch.randn(SIZES[i % len(SIZES)], FEATURES, generator=g)
            return x, x.square().mean(-1, keepdim=True)

    class MLP(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[torch.nn.Module] = []
            for i in range(4):
                layers += [torch.nn.Linear(FEATURES if i == 0 else width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
            self.net = torch.compile(torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)))

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return MLP(), DataLoader(Batches(), batch_size=None, shuffle=False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("dlrm", "mlp"), required=True)
    p.add_argument("--cache-dir", required=True, help="CompileCache(cache_dir=...): shared by all attempts")
    p.add_argument("--default-inductor-root", required=True, help="each attempt's empty default inductor dir goes here")
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--width", type=int, default=256, help="MLP width")
    p.add_argument("--host", choices=("same", "fresh"), default="fresh", help="a restart on this host or another one")
    p.add_argument("--no-cache", action="store_true", help="the control: no CompileCache")
    args = p.parse_args()
    attempt = int(os.environ.get("LIGHTNING_ETT_ATTEMPT", "0"))
    inductor = Path(args.default_inductor_root) / (f"attempt-{attempt}" if args.host == "fresh" else "this-host")
    inductor.mkdir(parents=True, exist_ok=args.host == "same")  # fresh: must be new, another host's empty directory
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)  # inductor reads it at every lookup (torch may be preloaded)

    from lightning.pytorch import Callback, Trainer

    from lightning_ett import CompileCache, DynamicShapes, ETTMonitor
    from lightning_ett.compile.cache import compile_metrics
    from lightning_ett.instrument.compile_events import compile_tracker

    cache = None if args.no_cache else CompileCache(args.cache_dir, compile_module=args.model == "dlrm")
    out = Path(args.out)
    fit_start = 0.0

    class FirstStepFacts(Callback):
        written = False

        def on_train_batch_end(self, *_: object) -> None:
            if not self.written:
                self.written = True
                tracker = compile_tracker()
                facts = {"attempt": attempt, "fit_start": fit_start, "first_step_end": time.time(),
                         "compile_s": tracker.seconds, "graphs": tracker.compiles, "recompiles": tracker.recompiles,
                         **compile_metrics(), "loaded": cache is not None and cache.loaded}
                (out / f"attempt-{attempt}.json").write_text(json.dumps(facts))

    # ETTMonitor first: its ledger's end of step 1 is the step, not the bundle save after it (the kill
    # comes later, at LIGHTNING_ETT_FAULT_KILL's step >= 2, after the cache saved its bundle at step 1).
    callbacks = [ETTMonitor(report_on_end=False), *([cache] if cache else []), FirstStepFacts()]
    if args.model == "dlrm":
        from examples.dlrm_example import DLRMModule, RandomCriteoDataModule

        model, data = DLRMModule(), RandomCriteoDataModule(batch_size=512)
        if cache is None:
            model.compile()  # what CompileCache(compile_module=True) does in setup
    else:
        model, data = mlp_job(args.width)
        callbacks.insert(1, DynamicShapes())
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=args.max_steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                      callbacks=callbacks)
    fit_start = time.time()
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
