"""How long the interpreter's own teardown takes after the last exit handler of a Lightning job.

That time is after the last event a process can record (its last exit handler), so no
in-process ledger sees it; ``lightning run`` counts it (the launcher's end closes the wall
time). Each round starts ``python -c JOB``: imports torch, Lightning, TorchRec and Dynamo,
fits BoringModel for 3 steps, and registers, first, an exit handler that prints the time (exit
handlers run last-registered-first, so it is the last one); the parent notes when the process
is gone.

    .venv/bin/python benchmarks/interpreter_teardown.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

JOB = r"""
import atexit, time
atexit.register(lambda: print(repr(time.time()), flush=True))
import torch, lightning.pytorch as pl, torchrec, torch._dynamo
from lightning.pytorch.demos.boring_classes import BoringModel
pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
           enable_checkpointing=False).fit(BoringModel())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    seconds = []
    for r in range(args.rounds + 1):  # round 0 is untimed: it reads the libraries into the page cache
        proc = subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate()
        gone = time.time()
        if proc.returncode != 0 or not out.strip():
            raise RuntimeError(f"the job exited {proc.returncode}; its stderr ends:\n{err[-3000:]}")
        if r:
            seconds.append(gone - float(out.strip().splitlines()[-1]))
    print(f"teardown after the last exit handler: median {statistics.median(seconds):.2f} s, "
          f"range {min(seconds):.2f}-{max(seconds):.2f} s over {args.rounds} rounds")


if __name__ == "__main__":
    main()
