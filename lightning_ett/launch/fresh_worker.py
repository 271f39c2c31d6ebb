"""``lightning run --no-preload``'s worker: a fresh interpreter that prepares itself as a forked worker does.

torchrun would start ``python -u SCRIPT``; the launcher starts ``python -u -m lightning_ett.launch.fresh_worker
SCRIPT ARGS`` instead, so that a fresh worker too dies with the launcher, leads its process group, dumps
its stacks and serves its flight recorder from before the script's first line, and says when an error
cannot succeed on retry — whether or not the script builds an ETTMonitor. The script then runs as
``python SCRIPT ARGS`` would run it (:func:`lightning_ett.launch.worker.run_as_main`).
"""

from __future__ import annotations

import os
import sys

from lightning_ett.launch.worker import prepare_worker, run_as_main


def main(argv: list[str]) -> None:
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]  # `-m` put the working directory first; `python SCRIPT` puts only the script's directory
    prepare_worker(forked_by_server=False)
    code = 0
    try:
        run_as_main(argv[0], argv[1:])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # exit handlers ran in run_as_main; skip the interpreter's teardown (about 1 s with torch)


if __name__ == "__main__":
    main(sys.argv[1:])
