"""One start of the example DLRM (1 CPU process) compiled through CompileCache(compile_module=True).

Writes to OUT: seconds from process start to the end of the first training step, the compile
time, and the cache counters. Run by compile_restart.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_ett.instrument.environment import process_start_time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--monitor", action="store_true", help="add ETTMonitor (ledger, fault injection) for lightning run")
    args = p.parse_args()
    started = process_start_time()

    from lightning.pytorch import Callback, Trainer

    from examples.dlrm_example import DLRMModule, RandomCriteoDataModule
    from lightning_ett import CompileCache, ETTMonitor
    from lightning_ett.instrument.compile_events import compile_tracker

    class FirstStep(Callback):
        at: float | None = None

        def on_train_batch_end(self, *args: object) -> None:
            self.at = self.at or time.time()

    first, cache = FirstStep(), CompileCache(args.cache_dir, compile_module=True)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                      callbacks=[first, cache] + ([ETTMonitor(report_on_end=False)] if args.monitor else []))
    trainer.fit(DLRMModule(), RandomCriteoDataModule(batch_size=512))
    Path(args.out).write_text(json.dumps({"first_step_s": first.at - started, "compile_s": compile_tracker().seconds,
                                          **cache.metrics(), "loaded": cache.loaded}))


if __name__ == "__main__":
    main()
